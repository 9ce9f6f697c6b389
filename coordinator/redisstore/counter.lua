-- counter.lua: one operation on one calendar quota's counter, the arithmetic of internal/bucket
-- (Counter.Take with the share and unit of State.TakeShare, Counter.Return, FreshCounter for a
-- missing key) plus the idempotency records of coordinator.OpID, as in bucket.lua. It touches
-- KEYS[1] only and makes no network call.
--
-- KEYS[1]  the counter: a hash with
--   t          tokens left of the period's quota (microtokens)
--   l          the key clock (ms): the latest clock reading seen
--   p          the start of the counter's period (ms)
--   x          logical expiry on the key clock: the end of the period plus the margin
--   a:<agent>  that agent's last Take:   "seq granted remaining retry credited 0 0 now"
--   r:<agent>  that agent's last Return: "seq credited remaining now"
-- ARGV     op ("take" | "return"), quota (µ), start, end, next (the window: the period of the
--          coordinator's clock [start, end) and the one after it [end, next), ms),
--          take: want, least, share (1..1000) | return: amount, granted_at, 0,
--          agent ("" = not idempotent), seq, now ("" = Redis TIME),
--          record_keep, max_records, expiry_margin (coordinator constants),
--          take: unit, ret_amount, ret_granted_at (a lease handed back before the take, in the
--          same operation; ret_amount 0 for none) | return: 1, 0, 0
-- Returns  {granted, remaining, retry_after, now, flags, credited, 0} as bucket.lua does (no
--          contention rule: the pace is always 0), or an error reply "OUTSIDE_WINDOW ..." when the
--          key clock is outside the window, changing nothing.
--
-- Numbers are IEEE doubles. Every value is an integer of magnitude at most 2^53 - 1 (the quota,
-- amounts and times are at most 2^52, checked by the coordinator): only comparisons, additions
-- and subtractions of them, and the permille split of bucket.lua, which stays below 2^53.

local key = KEYS[1]
local op = ARGV[1]
local quota = tonumber(ARGV[2])
local w_start = tonumber(ARGV[3])
local w_end = tonumber(ARGV[4])
local w_next = tonumber(ARGV[5])
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

-- floor(a / b) for integers 0 <= a, 1 <= b below 2^53, exactly (bucket.lua's idiv).
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q = q - 1
  elseif r >= b then
    q = q + 1
  end
  return q
end

local function int(x)
  return string.format('%d', x)
end

local now
if injected then
  now = tonumber(ARGV[11])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 -- seconds since 1970 * 1000 < 2^53 for another 285,000 years
    + idiv(tonumber(time[2]), 1000)
end

local rec_field = nil
if agent ~= '' then
  rec_field = (op == 'take' and 'a:' or 'r:') .. agent
end
local h = redis.call('HMGET', key, 't', 'l', 'p', 'x', rec_field or 't')
local tokens, last, period, expiry = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]), tonumber(h[4])
local record = rec_field and h[5] or nil

-- A key past its logical expiry is a fresh counter with no records.
if tokens and expiry and now >= expiry then
  redis.call('DEL', key)
  tokens, last, period, expiry, record = nil, nil, nil, nil, nil
end

-- Idempotency, as in bucket.lua.
if record then
  local f = {}
  for w in string.gmatch(record, '%S+') do
    f[#f + 1] = tonumber(w)
  end
  if f[1] == seq then
    if op == 'take' then
      return {f[2], f[3], f[4], f[8], REPLAYED, f[5], 0}
    end
    return {f[2], f[3], 0, f[4], REPLAYED, 0, 0}
  elseif f[1] > seq then
    return {0, tokens, 0, last, STALE, 0, 0}
  end
end

if not tokens or not last then
  tokens, last, period = quota, now, 0 -- bucket.FreshCounter
end
period = period or 0

-- Counter.advance: the clock never goes back; the counter moves to the period of its clock in
-- the window, full again when that period is later than its own.
last = math.max(last, now)
local p, p_end
if last < w_start or last >= w_next then
  return redis.error_reply(string.format('OUTSIDE_WINDOW clock %d ms, window %d..%d', last, w_start, w_next))
elseif last < w_end then
  p, p_end = w_start, w_end
else
  p, p_end = w_end, w_next
end
if p < period then
  return redis.error_reply(string.format('OUTSIDE_WINDOW the key is in the period from %d ms, the window\'s is from %d ms', period, p))
end
if p > period then
  period, tokens = p, quota
end

-- Counter.Return: only a lease of this period, at most what the period spent.
local function credit(amount, granted_at)
  local c = 0
  if granted_at >= period then
    c = math.max(0, math.min(amount, quota - tokens))
  end
  tokens = tokens + c
  return c
end

local granted, retry, credited = 0, 0, 0
if op == 'take' then
  if ret_amount > 0 then
    credited = credit(ret_amount, ret_granted_at)
  end
  -- Counter.Take: State.TakeShare without a refill (nothing to take when the request only hands
  -- a lease back)
  local capped = want
  if share < WHOLE then
    local part = idiv(tokens, WHOLE) * share -- <= tokens*share/1000 <= tokens
      + idiv((tokens - idiv(tokens, WHOLE) * WHOLE) * share, WHOLE) -- < 1000*1000
    capped = math.min(want, math.max(least, part))
  end
  if want == 0 then
    granted = 0
  elseif tokens >= least then
    granted = math.min(capped, tokens)
    if granted < want and unit > 1 then
      granted = math.max(least, idiv(granted, unit) * unit) -- <= granted
    end
    tokens = tokens - granted
  elseif least > quota then
    retry = NEVER
  else
    retry = p_end - last -- >= 1: last < p_end
  end
else
  granted = credit(want, least)
end

-- Expiry: the next period starts from a fresh counter.
local new_expiry = p_end + expiry_margin -- <= 2^52 + a margin
local fields = {'t', int(tokens), 'l', int(last), 'p', int(period), 'x', int(new_expiry)}
if rec_field then
  fields[#fields + 1] = rec_field
  if op == 'take' then
    fields[#fields + 1] = string.format('%d %d %d %d %d 0 0 %d', seq, granted, tokens, retry, credited, last)
  else
    fields[#fields + 1] = string.format('%d %d %d %d', seq, granted, tokens, last)
  end
end
redis.call('HSET', key, unpack(fields))
if not injected then
  redis.call('PEXPIRE', key, int(new_expiry - now)) -- > expiry_margin: now <= last < p_end
end

-- Sweep, as in bucket.lua: fields t, l, p, x and the records.
if rec_field then
  local records = redis.call('HLEN', key) - 4
  if records > max_records then
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local prefix = string.sub(all[i], 1, 2)
      if prefix == 'a:' or prefix == 'r:' then
        local at = tonumber(string.match(all[i + 1], '(%S+)$'))
        if last - at > record_keep then
          redis.call('HDEL', key, all[i])
        end
      end
    end
  end
end

return {granted, tokens, retry, last, 0, credited, 0}
