-- bucket.lua: one operation on one global token bucket, the arithmetic of internal/bucket
-- (State.TakeShare, State.Return, Full for a missing key) plus the idempotency records of
-- coordinator.OpID. It touches KEYS[1] only and makes no network call.
--
-- KEYS[1]  the bucket: a hash with
--   t          tokens (microtokens)
--   l          last refill (ms, the key clock)
--   f          the fraction of a microtoken refilled but not yet credited, in 1/den µ
--   x          logical expiry on the key clock; absent when the key never expires
--   c          the key clock until which its agents compete (lease.Contend); absent until a take
--              was contended
--   a:<agent>  that agent's last Take:   "seq granted remaining retry credited pace demand debited
--              now" (records of older versions hold "seq granted remaining retry credited pace
--              demand now" or "seq granted remaining retry [credited] now", no debt; the time is
--              always the last word)
--   r:<agent>  that agent's last Return: "seq credited remaining now"
-- ARGV     op ("take" | "return"), capacity, num, den, fill (the bucket.Limit),
--          take: want, least, share (1..1000) | return: amount, granted_at, 0,
--          agent ("" = not idempotent), seq, now ("" = Redis TIME),
--          record_keep, max_records, expiry_margin (coordinator constants),
--          take: unit, ret_amount, ret_granted_at (a lease handed back before the take, in the
--          same operation; ret_amount 0 for none), demand (µ/s, at most lease.MaxShareDemand),
--          ttl (the lease lifetime in ms, 0 for direct mode), debt (µ settled after the fact,
--          charged after the handed-back lease and before the take), max_debt (µ, 0..capacity:
--          how far below zero the debt may take the bucket), ample (µ: what to take instead of
--          want where the bucket stays ample, lease.Ample; 0 for none) | return: 1, 0, 0, 0, 0,
--          0, 0, 0
-- Returns  {granted, remaining, retry_after, now, flags, credited, pace, debited}; flags:
--          1 replayed, 2 stale; credited is what a take's handed-back lease was credited (0 for a
--          return: its credit is granted); pace is how long the agent waits before it asks again
--          after a contended take (lease.Contend, lease.Pace), else 0; debited is what was charged
--          of the debt (State.Charge; the rest was forgiven).
--
-- Tokens may be below zero, down to -max_debt >= -capacity, after a debt: every value formed from
-- them (capacity - tokens, least - tokens, tokens + max_debt) stays within 2 * capacity.
--
-- Numbers are IEEE doubles. Every value below is an integer of magnitude at most 2^53 - 1, where a
-- double is exact, so + - * and comparisons are exact; the bound is noted beside each
-- multiplication (bucket.NewLimit guarantees the invariants it relies on). Division is never used
-- directly: idiv computes an exact floor. Numbers are written with %d, never tostring's %.14g.
--
-- intmath.lua, common.lua and refill.lua, prepended to this script: idiv, ceil_div and int; ARGV
-- 1 and 6..17, now, rec_field, take_share, charge and sweep; added, time_for, credit (State.Return),
-- refill and store_bucket.

local capacity = tonumber(ARGV[2])
local num = tonumber(ARGV[3]) -- refill: num microtokens every den ms; num == 0 never refills
local den = tonumber(ARGV[4])
local fill = tonumber(ARGV[5]) -- ms for an empty bucket to fill; 0 when num == 0
local demand = tonumber(ARGV[18]) -- take: the agent's demand, µ/s (<= 2^43)
local ttl = tonumber(ARGV[19]) -- take: the lease lifetime, ms (0: direct mode, no contention rule)
local debt = tonumber(ARGV[20]) -- take: µ settled after the fact, charged before the take
local max_debt = tonumber(ARGV[21]) -- take: how far below zero the debt may go, µ (<= capacity)
local ample = tonumber(ARGV[22]) -- take: the grant where the bucket stays ample, µ (0: none)
local FRESH = 2 -- lease.FreshLeases
local THIN = 16 -- lease.ThinRequests
local SHARE = 500 -- lease.Share
local MAX_SHARE_DEMAND = 8796093022208 -- lease.MaxShareDemand, 2^43

-- The limit, for refill.lua's added, time_for, credit and refill.
local lim = {capacity = capacity, num = num, den = den, fill = fill}

local h = redis.call('HMGET', key, 't', 'l', 'x', 'f', 'c', rec_field or 't')
local tokens, last, expiry, frac = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]), tonumber(h[4]) or 0
local compete_until = tonumber(h[5])
local record = rec_field and h[6] or nil

-- A key past its logical expiry is a full bucket with no records.
if tokens and expiry and now >= expiry then
  redis.call('DEL', key)
  tokens, last, expiry, frac, compete_until, record = nil, nil, nil, 0, nil, nil
end

-- Idempotency (common.lua): a repeat is answered from its record, an older operation is stale.
local took_at = nil -- the key clock of this agent's last take (lease.Contend)
local rec_at, answer = replay(record, tokens, last)
if answer then
  return answer
end
if op == 'take' then
  took_at = rec_at
end

-- The record this operation writes is new on a key that held state: only then may the sweep
-- (common.lua) find more records than it keeps.
local new_record = not record and tokens ~= nil and last ~= nil
if not tokens or not last then
  tokens, last, frac = capacity, now, 0 -- bucket.Full
end

-- State.Refill (refill.lua), from a debt too.
tokens, last, frac = refill(lim, tokens, last, frac, now)

-- What an empty bucket refills in ms (Limit.Refilled): whole microtokens, at most the capacity.
local function refilled(ms)
  if ms <= 0 or num == 0 then
    return 0
  elseif ms >= fill then
    return capacity
  end
  local add = added(lim, ms, 0)
  return add
end

-- x*p/1000 rounded down for 0 <= p <= 1000 without forming x*p (bucket.Permille).
local function permille(x, p)
  return idiv(x, WHOLE) * p -- <= x
    + idiv((x - idiv(x, WHOLE) * WHOLE) * p, WHOLE) -- < 1000*1000
end

-- the longest pace (lease.Pace): three quarters of a lifetime (lease.LowWater = 250‰)
local longest = ttl - idiv(ttl * 250, 1000)
local granted, retry, credited, pace, debited = 0, 0, 0, 0, 0
if op == 'take' then
  if ret_amount > 0 then
    -- State.Return (refill.lua), before the debt and the take
    credited, tokens, frac = credit(lim, tokens, last, frac, ret_amount, ret_granted_at)
  end
  -- State.Charge (common.lua): the debt, after the credit and before the take
  if debt > 0 then
    debited = charge(tokens, debt, max_debt)
    tokens = tokens - debited -- >= -max_debt
  end
  -- lease.Contend: a take that would leave the bucket low (below a quarter of its capacity,
  -- lease.Reserve), or on a key whose agents compete (c), on a key whose agents' demand (its own
  -- and every other agent's fresh take record) over a lifetime is at least what it refills and
  -- holds (overloaded), is cut to the agent's share of that demand of the refill over a lifetime.
  local mine, contended, per_check = 0, false, false
  -- lease.Ample: where the bucket keeps three quarters of its capacity after it, a lease holds
  -- the demand over its whole lifetime (the contention rule below still applies to it)
  if ample > want and tokens - ample >= capacity - idiv(capacity, 4) then
    want = ample
  end
  local low = tokens - want < idiv(capacity, 4)
  local competing = compete_until and last < compete_until
  if want > 0 and ttl > 0 and demand > 0 and (low or competing) then
    local total, others = demand, false
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      if string.sub(all[i], 1, 2) == 'a:' and all[i] ~= rec_field then
        local f = {}
        for w in string.gmatch(all[i + 1], '%S+') do
          f[#f + 1] = tonumber(w)
        end
        if (#f == 8 or #f == 9) and last - f[#f] <= FRESH * ttl then
          total = total + f[7] -- each <= 2^43, at most a few hundred records
          others = true
        end
      end
    end
    total = math.max(demand, math.min(total, MAX_SHARE_DEMAND))
    local refill = refilled(ttl)
    -- overloaded: the demand over a lifetime (total/1000 < 2^34, ttl <= 30000) is at least the
    -- refill in it plus what the bucket holds (each below 2^53)
    if idiv(total, WHOLE) * ttl >= refill + math.max(0, tokens) then
      mine = idiv(demand * WHOLE, total) -- demand*1000 < 2^53
      -- its share of what refilled since it last took: a lifetime if it never did or long ago,
      -- at most FRESH lifetimes
      local since = ttl
      if took_at and last - took_at > 0 and last - took_at <= FRESH * ttl then
        since = last - took_at
      end
      -- and its share of what the bucket holds (the sum capped at the capacity, compared without
      -- forming a sum above it)
      local pool = refilled(since)
      if pool <= capacity - tokens then
        pool = math.max(0, pool + tokens) -- a bucket in debt may have nothing to share
      else
        pool = capacity
      end
      -- where other agents took too, a share above the share cap counts as the cap (lease.Share:
      -- their demand may not be measured yet)
      local most = mine
      if others then
        most = math.min(mine, SHARE)
      end
      local fair = permille(pool, most)
      -- that share whatever it asked for, at most its demand until it asks again: the longest pace
      -- (demand/1000 < 2^34, ttl <= 30000)
      fair = math.min(fair, idiv(demand, WHOLE) * longest)
      fair = idiv(fair, unit) * unit -- whole units, <= fair
      want = math.max(least, fair)
      -- per check where its demand over a lifetime, m requests, exceeds that by less than the
      -- square root of m (m < THIN, so the square is small)
      local m = idiv(idiv(demand, WHOLE) * ttl, unit)
      if m < THIN then
        local left = m - idiv(fair, unit)
        if left * left < m then
          want = least
          per_check = true
        end
      end
      share = WHOLE -- the contention rule applied the share cap to the pool
      contended = true
      compete_until = last + FRESH * ttl -- last < 2^52, ttl <= 30000
    end
  end
  -- State.TakeShare (common.lua)
  local g = take_share(tokens, want, share)
  if g then
    granted = g
    tokens = tokens - granted
  elseif least > capacity or num == 0 then
    retry = NEVER
  else
    retry = time_for(lim, least - tokens, frac)
  end
  if contended and (granted == 0 or not per_check) then
    -- lease.Pace (a grant taken per check does not pace the agent, a denial does): until the
    -- agent's share of the refill covers what it got (or, denied, needs), at least the others'
    -- share of a lifetime, at most three quarters of one.
    local amount = granted
    if amount == 0 then
      amount = least
    end
    local tf = 0
    if num > 0 then
      tf = time_for(lim, math.min(amount, capacity), 0)
    end
    if mine <= 0 or tf >= ttl then
      pace = longest
    else
      -- tf < ttl <= 30000; at least the others' share of a lifetime and half a lifetime
      -- (lease.Refills)
      local floor = math.max(idiv(ttl * (WHOLE - mine), WHOLE), idiv(ttl, 2))
      pace = math.min(longest, math.max(ceil_div(tf * WHOLE, mine), floor))
    end
  end
else
  -- State.Return (refill.lua): want is the amount returned, least the lease's grant time
  granted, tokens, frac = credit(lim, tokens, last, frac, want, least)
end

-- Store (refill.lua): the bucket, its contention field and the record.
local extra = {}
if compete_until then
  extra[#extra + 1] = 'c'
  extra[#extra + 1] = int(compete_until)
end
if rec_field then
  extra[#extra + 1] = rec_field
  if op == 'take' then
    extra[#extra + 1] = string.format('%d %d %d %d %d %d %d %d %d', seq, granted, tokens, retry, credited, pace, demand, debited, last)
  else
    extra[#extra + 1] = string.format('%d %d %d %d', seq, granted, tokens, last)
  end
end
local has_expiry = store_bucket(key, lim, tokens, last, frac, expiry, extra)

-- Sweep (common.lua): besides the records, the key holds t, l, f, and x and c when it has them.
local fixed = 3
if has_expiry then
  fixed = fixed + 1
end
if compete_until then
  fixed = fixed + 1
end
sweep(fixed, last, new_record)

return {granted, tokens, retry, last, 0, credited, pace, debited}
