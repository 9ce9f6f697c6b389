-- refill.lua: a token bucket's refill arithmetic, the credit of a lease handed back, and how a
-- bucket is stored, for a limit m = {capacity, num, den, fill} (the bucket.Limit: num microtokens
-- every den ms, fill ms for an empty bucket to fill), shared by bucket.lua and multi.lua.
-- redisstore.go prepends it, after intmath.lua and common.lua. Numbers follow bucket.lua's header:
-- integers below 2^53, no division but idiv.

-- The refill of 0 <= elapsed <= fill ms on top of a remainder 0 <= frac < den (Limit.added):
-- whole microtokens and the new remainder of (elapsed*num + frac) / den.
local function added(m, elapsed, frac)
  local q = idiv(elapsed, m.den)
  local r = elapsed - q * m.den -- q*den <= elapsed
  local t = r * m.num + frac -- r*num + frac < den*num + den = (num+1)*den <= 2^53 - 1
  local w = idiv(t, m.den)
  return q * m.num + w, -- q*num <= fill*num/den < capacity + num <= 2^53 - 1
    t - w * m.den -- w*den <= t
end

-- ceil((amount*den - frac) / num) for 0 <= amount <= 2*capacity, 0 <= frac < den, num > 0
-- (Limit.timeForFrac): the ms until amount more microtokens are there (up to 2*capacity from a
-- debt: least - tokens, capacity - tokens).
local function time_for(m, amount, frac)
  local q = idiv(amount, m.num)
  local r = amount - q * m.num -- q*num <= amount
  local x = r * m.den - frac -- r*den < num*den <= 2^53 - 1; x > -den
  if x >= 0 then
    return q * m.den -- q*den <= amount*den/num <= 2*capacity*den/num <= 2*MaxFill = 2^46
      + ceil_div(x, m.num)
  end
  return q * m.den - idiv(-x, m.num) -- the ceiling of a negative quotient
end

-- ceil(age * num / den) for 0 < age < fill (Limit.timeDecay): the refill in age, rounded up.
local function time_decay(m, age)
  local q = idiv(age, m.den)
  local r = age - q * m.den -- q*den <= age
  return q * m.num -- q*num <= age*num/den < capacity + num <= 2^53 - 1
    + ceil_div(r * m.num, m.den) -- r*num < den*num <= 2^53 - 1
end

-- State.Return on a bucket already refilled to last: amount unspent microtokens of a lease granted
-- at granted_at. No lease exceeds the capacity, so neither does the credit; it decays by the
-- refill since the grant, rounded up, and is capped at what the bucket can hold (capacity - tokens
-- <= 2*capacity from a debt). Returns the credit, tokens and frac (a full bucket keeps no
-- fraction).
local function credit(m, tokens, last, frac, amount, granted_at)
  local c = math.min(amount, m.capacity)
  local age = last - granted_at -- both below 2^52
  if age > 0 and m.num > 0 then
    if age >= m.fill then
      c = 0 -- a full bucket's worth of refill has passed: nothing left to credit
    else
      c = c - time_decay(m, age) -- time_decay < capacity + num
    end
  end
  c = math.max(0, math.min(c, m.capacity - tokens))
  tokens = tokens + c
  if tokens == m.capacity then
    frac = 0
  end
  return c, tokens, frac
end

-- State.Refill: credit the time from last to now, capped at capacity, keeping the fraction of a
-- microtoken for the next refill; a clock that went back credits nothing and leaves last where
-- it was. From a debt (tokens < 0) first the time to reach zero (at most fill ms: -tokens <=
-- capacity), then the rest from there: the clamp to a whole fill holds only from zero up.
-- Returns tokens, last, frac.
local function refill(m, tokens, last, frac, now)
  local elapsed = now - last
  if elapsed <= 0 then
    return tokens, last, frac
  end
  last = now
  if tokens < 0 and m.num > 0 then
    local zero = time_for(m, -tokens, frac)
    local add
    if elapsed < zero then
      add, frac = added(m, elapsed, frac)
      return tokens + add, last, frac -- still below zero: add < -tokens
    end
    add, frac = added(m, zero, frac)
    tokens = tokens + add -- 0 <= tokens < num + 1
    elapsed = elapsed - zero
    if tokens >= m.capacity then
      return m.capacity, last, 0
    end
    if elapsed <= 0 then
      return tokens, last, frac
    end
  end
  if tokens >= m.capacity or m.num == 0 then
    return tokens, last, 0 -- full, or never refills
  elseif elapsed >= m.fill then -- clamp elapsed to the time to fill before multiplying
    return m.capacity, last, 0
  end
  local add
  add, frac = added(m, elapsed, frac)
  tokens = tokens + add -- <= 2*capacity + num <= 2^53 - 1
  if tokens >= m.capacity then
    return m.capacity, last, 0
  end
  return tokens, last, frac
end

-- Store a bucket (bucket.lua and multi.lua): its fields t, l, f and, when it expires, x (once
-- full, State.TimeToFull, plus the margin the key is a full bucket again and needs no state; a
-- bucket that is not full and never refills must persist), then the fields of extra; the key's
-- expiry follows (had_expiry: the key held x before). Returns whether the key expires.
local function store_bucket(key, m, tokens, last, frac, had_expiry, extra)
  local has_expiry = tokens >= m.capacity or m.num > 0
  local fields = {'t', int(tokens), 'l', int(last), 'f', int(frac)}
  local new_expiry = 0
  if has_expiry then
    local ttf = 0
    if tokens < m.capacity then
      ttf = time_for(m, m.capacity - tokens, frac) -- from a debt too: capacity - tokens <= 2*capacity
    end
    new_expiry = last + ttf + expiry_margin -- last < 2^52, ttf <= 2^46
    fields[#fields + 1] = 'x'
    fields[#fields + 1] = int(new_expiry)
  end
  for i = 1, #extra do
    fields[#fields + 1] = extra[i]
  end
  redis.call('HSET', key, unpack(fields))
  if has_expiry then
    if not injected then
      redis.call('PEXPIRE', key, int(new_expiry - now)) -- >= expiry_margin: last >= now
    end
  elseif had_expiry then
    redis.call('HDEL', key, 'x')
    if not injected then
      redis.call('PERSIST', key)
    end
  end
  return has_expiry
end
