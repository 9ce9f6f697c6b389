-- common.lua: what bucket.lua and counter.lua share. redisstore.go prepends it to each, so each
-- script is still one self-contained EVAL touching KEYS[1] only. It reads the arguments both take
-- alike (ARGV 1 and 6..17, see either script's header) and defines the clock, the field of the
-- calling agent's idempotency record and its replay, a take's share of the tokens and the sweep of old records.
-- It follows intmath.lua. Numbers follow bucket.lua's header: integers below 2^53, no division
-- but idiv, written with %d.

local key = KEYS[1]
local op = ARGV[1]
local want = tonumber(ARGV[6]) -- take: microtokens wanted; return: microtokens returned
local least = tonumber(ARGV[7]) -- take: minimum grant; return: the lease's grant time (ms)
local share = tonumber(ARGV[8]) -- take: permille cap of the grant
local agent = ARGV[9]
local seq = tonumber(ARGV[10])
local injected = ARGV[11] ~= '' -- a test or simulator clock: no PEXPIRE, it is not wall time
local record_keep = tonumber(ARGV[12])
local max_records = tonumber(ARGV[13])
local expiry_margin = tonumber(ARGV[14])
local unit = tonumber(ARGV[15]) -- take: grants cut below want are whole multiples of it
local ret_amount = tonumber(ARGV[16]) -- take: unspent µ of a lease handed back first
local ret_granted_at = tonumber(ARGV[17]) -- take: that lease's grant time (ms)

local WHOLE = 1000 -- bucket.WholeShare
local NEVER = -1 -- bucket.Never
local REPLAYED, STALE = 1, 2

-- now: the injected clock, or Redis TIME in milliseconds (intmath.lua).
local now
if injected then
  now = tonumber(ARGV[11])
else
  now = redis_ms()
end

-- The calling agent's record of its last take or return (coordinator.OpID); nil when the call is
-- not idempotent.
local rec_field = nil
if agent ~= '' then
  if op == 'multi' then
    rec_field = 'm:' .. agent -- multi.lua: a take of several buckets, recorded in the first
  else
    -- a return to several buckets (multi.lua) keeps the record of a return to the first alone
    rec_field = (op == 'take' and 'a:' or 'r:') .. agent
  end
end

-- Idempotency: the time of the calling agent's last record on the key (its last word; nil
-- without one), and the answer to a repeat of that operation (REPLAYED, from the record) or to an
-- older one (STALE), nil for a new operation. Neither changes anything. Only a repeat's record is
-- parsed whole. Take records hold "seq granted remaining
-- retry credited pace demand debited now" (older versions "seq granted remaining retry credited
-- pace demand now" and "seq granted remaining retry [credited] now": no debt charged), return
-- records "seq credited remaining now", multi.lua's records "seq granted remaining retry refused
-- now"; the time is always the last word. An answer is the take scripts' reply: {granted,
-- remaining, retry_after, now, flags, credited, pace, debited}.
local function replay(record, tokens, last)
  if not record then
    return nil, nil
  end
  local first = tonumber(string.match(record, '^%S+'))
  if first < seq then
    return tonumber(string.match(record, '%S+$')), nil
  elseif first > seq then
    return nil, {0, tokens, 0, last, STALE, 0, 0, 0}
  end
  local f = {}
  for w in string.gmatch(record, '%S+') do
    f[#f + 1] = tonumber(w)
  end
  local at = f[#f]
  if op == 'multi' then -- "seq granted remaining retry refused now"
    return at, {f[2], f[3], f[4], f[6], REPLAYED, f[5], 0, 0}
  end
  if op == 'take' then
    if #f == 9 then
      return at, {f[2], f[3], f[4], f[9], REPLAYED, f[5], f[6], f[8]}
    elseif #f == 8 then
      return at, {f[2], f[3], f[4], f[8], REPLAYED, f[5], f[6], 0}
    elseif #f == 6 then
      return at, {f[2], f[3], f[4], f[6], REPLAYED, f[5], 0, 0}
    end
    return at, {f[2], f[3], f[4], f[5], REPLAYED, 0, 0, 0}
  end
  return at, {f[2], f[3], 0, f[4], REPLAYED, 0, 0, 0}
end

-- State.TakeShare on tokens already refilled: the grant of a take of want, at least least, capped at
-- share/1000 of tokens (never below least) and, when cut below want, in whole units; 0 when the
-- request only hands a lease back (want 0); nil when tokens hold less than least.
local function take_share(tokens, want, share)
  if want == 0 then
    return 0
  end
  if tokens < least then
    return nil
  end
  local capped = want
  if share < WHOLE then
    local part = idiv(tokens, WHOLE) * share -- <= tokens*share/1000 <= tokens
      + idiv((tokens - idiv(tokens, WHOLE) * WHOLE) * share, WHOLE) -- < 1000*1000
    capped = math.min(want, math.max(least, part))
  end
  local granted = math.min(capped, tokens)
  if granted < want and unit > 1 then
    granted = math.max(least, idiv(granted, unit) * unit) -- <= granted
  end
  return granted
end

-- State.Charge on tokens already refilled: a cost settled after the fact, debited even below
-- zero but never below -max_debt (the rest is forgiven); returns what was debited. Tokens stay
-- at least -max_debt >= -capacity: tokens + max_debt <= 2 * capacity < 2^53.
local function charge(tokens, debt, max_debt)
  return math.max(0, math.min(debt, tokens + max_debt))
end

-- Sweep: when this operation added its record to a key that held state before (new_record: the
-- record's field did not exist; on a key that did not, the operation wrote the only record), and
-- the key now holds more than max_records records besides its fixed fields, drop those older than
-- record_keep on the key clock last. Records are counted only when one is added, as only then
-- can there be more: an agent's next operation rewrites its own record, and costs no HLEN. The
-- loop walks only this key's own fields: the records of agents active within record_keep plus at
-- most max_records older ones.
local function sweep(fixed, last, new_record)
  if not rec_field or not new_record or redis.call('HLEN', key) - fixed <= max_records then
    return
  end
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local prefix = string.sub(all[i], 1, 2)
    if prefix == 'a:' or prefix == 'r:' or prefix == 'm:' then
      local at = tonumber(string.match(all[i + 1], '(%S+)$'))
      if last - at > record_keep then
        redis.call('HDEL', key, all[i])
      end
    end
  end
end

