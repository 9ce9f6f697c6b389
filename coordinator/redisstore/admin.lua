-- admin.lua: the admin operations on one global bucket (coordinator.AdminStore): read it, or set
-- its level. It touches KEYS[1] only and makes no network call. It keeps bucket.lua's meaning of
-- the hash: the same logical expiry, the same expiry arithmetic; idempotency records and fields
-- it does not know are left as they are.
--
-- KEYS[1]  the bucket: the hash bucket.lua writes (t tokens, l last refill, f fraction, x expiry,
--          a:<agent> and r:<agent> records)
-- ARGV     op ("inspect" | "set"), now ("" = Redis TIME);
--          set: capacity, num, den (the bucket.Limit), level (microtokens), expiry_margin
-- Returns  inspect: {now, HGETALL of the key}
--          set:     {now, HGETALL before, HGETALL after}
--
-- Numbers are IEEE doubles kept integers below 2^53 (bucket.NewLimit's invariants, as in
-- bucket.lua); they are written with %d. intmath.lua, prepended, defines idiv, ceil_div and int;
-- refill.lua, inserted at its marker below once the clock and the arguments are read, defines
-- store_bucket, which stores the level as bucket.lua stores a bucket.

local key = KEYS[1]
local op = ARGV[1]
local injected = ARGV[2] ~= '' -- a test clock: no PEXPIRE, it is not wall time

local now
if injected then
  now = tonumber(ARGV[2])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) -- time[2] < 10^6: exact
end

if op == 'inspect' then
  return {now, redis.call('HGETALL', key)}
end

local capacity = tonumber(ARGV[3])
local num = tonumber(ARGV[4]) -- refill: num microtokens every den ms; num == 0 never refills
local den = tonumber(ARGV[5])
local level = tonumber(ARGV[6]) -- 0 <= level <= capacity, checked by the caller
local expiry_margin = tonumber(ARGV[7])

-- refill.lua

local before = redis.call('HGETALL', key)
local h = redis.call('HMGET', key, 't', 'l', 'x')
local tokens, last, expiry = tonumber(h[1]), tonumber(h[2]), tonumber(h[3])

-- A key past its logical expiry is a full bucket with no records (bucket.lua drops it the same way).
if tokens and expiry and now >= expiry then
  redis.call('DEL', key)
  tokens, last, expiry = nil, nil, nil
end
if not tokens or not last or now > last then
  last = now -- the key clock never goes back
end

-- The level with no fraction; records and fields this script does not know stay as they are.
store_bucket(key, {capacity = capacity, num = num, den = den}, level, last, 0, expiry, {})

return {now, before, redis.call('HGETALL', key)}
