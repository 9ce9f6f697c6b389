-- counter.lua: one operation on one calendar quota's counter, the arithmetic of internal/bucket
-- (Counter.Take with the share and unit of State.TakeShare, Counter.Return, FreshCounter for a
-- missing key) plus the idempotency records of coordinator.OpID, as in bucket.lua. It touches
-- KEYS[1] only and makes no network call.
--
-- KEYS[1]  the counter: a hash with
--   t          tokens left of the period's quota (microtokens); below zero, down to -max_debt,
--              after a debt
--   l          the key clock (ms): the latest clock reading seen
--   p          the start of the counter's period (ms)
--   x          logical expiry on the key clock: the end of the period plus the margin
--   a:<agent>  that agent's last Take:   "seq granted remaining retry credited 0 0 debited now"
--              (older versions "seq granted remaining retry credited 0 0 now": no debt)
--   r:<agent>  that agent's last Return: "seq credited remaining now"
-- ARGV     op ("take" | "return"), quota (µ), start, end, next (the window: the period of the
--          coordinator's clock [start, end) and the one after it [end, next), ms),
--          take: want, least, share (1..1000) | return: amount, granted_at, 0,
--          agent ("" = not idempotent), seq, now ("" = Redis TIME),
--          record_keep, max_records, expiry_margin (coordinator constants),
--          take: unit, ret_amount, ret_granted_at (a lease handed back before the take, in the
--          same operation; ret_amount 0 for none), debt, max_debt (a cost settled after the
--          fact, charged after the handed-back lease and before the take, down to -max_debt,
--          max_debt <= quota) | return: 1, 0, 0, 0, 0
-- Returns  {granted, remaining, retry_after, now, flags, credited, 0, debited} as bucket.lua does
--          (no contention rule: the pace is always 0), or an error reply "OUTSIDE_WINDOW ..." when
--          the key clock is outside the window, changing nothing.
--
-- Numbers are IEEE doubles. Every value is an integer of magnitude at most 2^53 - 1 (the quota,
-- amounts and times are at most 2^52, checked by the coordinator; tokens at least -quota): only
-- comparisons, additions and subtractions of them, and the permille split of common.lua, which
-- stays below 2^53.
--
-- intmath.lua and common.lua, prepended to this script: idiv and int; ARGV 1 and 6..17, now,
-- rec_field, take_share, charge and sweep.

local quota = tonumber(ARGV[2])
local w_start = tonumber(ARGV[3])
local w_end = tonumber(ARGV[4])
local w_next = tonumber(ARGV[5])
local debt = tonumber(ARGV[18]) -- take: µ settled after the fact, charged before the take
local max_debt = tonumber(ARGV[19]) -- take: how far below zero the debt may go, µ (<= quota)

local h = redis.call('HMGET', key, 't', 'l', 'p', 'x', rec_field or 't')
local tokens, last, period, expiry = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]), tonumber(h[4])
local record = rec_field and h[5] or nil

-- A key past its logical expiry is a fresh counter with no records.
if tokens and expiry and now >= expiry then
  redis.call('DEL', key)
  tokens, last, period, expiry, record = nil, nil, nil, nil, nil
end

-- Idempotency (common.lua): a repeat is answered from its record, an older operation is stale.
local _, answer = replay(record, tokens, last)
if answer then
  return answer
end

-- The record this operation writes is new on a key that held state: only then may the sweep
-- (common.lua) find more records than it keeps.
local new_record = not record and tokens ~= nil and last ~= nil
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

local granted, retry, credited, debited = 0, 0, 0, 0
if op == 'take' then
  if ret_amount > 0 then
    credited = credit(ret_amount, ret_granted_at)
  end
  -- Counter.Charge (common.lua): the debt, after the credit and before the take
  if debt > 0 then
    debited = charge(tokens, debt, max_debt)
    tokens = tokens - debited -- >= -max_debt
  end
  -- Counter.Take: State.TakeShare without a refill (common.lua)
  local g = take_share(tokens, want, share)
  if g then
    granted = g
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
    fields[#fields + 1] = string.format('%d %d %d %d %d 0 0 %d %d', seq, granted, tokens, retry, credited, debited, last)
  else
    fields[#fields + 1] = string.format('%d %d %d %d', seq, granted, tokens, last)
  end
end
redis.call('HSET', key, unpack(fields))
if not injected then
  redis.call('PEXPIRE', key, int(new_expiry - now)) -- > expiry_margin: now <= last < p_end
end

-- Sweep (common.lua): besides the records, the key holds t, l, p and x.
sweep(4, last, new_record)

return {granted, tokens, retry, last, 0, credited, 0, debited}
