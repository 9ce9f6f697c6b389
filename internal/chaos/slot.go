package chaos

import "strings"

// KeySlot is the Redis Cluster hash slot of key: CRC16 (XMODEM) of the key, or of its hash tag
// (the part between the first "{" and the next "}", when not empty), modulo 16384. Bucket keys
// never hold a tag (policy escapes braces); the harness places keys with it to know which
// master an outage of one node affects.
func KeySlot(key string) int64 {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int64(crc % 16384)
}
