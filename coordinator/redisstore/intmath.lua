-- intmath.lua: exact integer arithmetic on Lua's doubles, and the Redis clock, prepended to every
-- script of this package (bucket.lua, counter.lua, multi.lua, admin.lua; batch.lua has it once,
-- outside the function it calls per key: redisstore.go). Arguments are integers below 2^53.

-- floor(a / b) for integers 0 <= a <= 2^53 - 1 and 1 <= b <= 2^53 - 1, exactly. Float division
-- rounds, and a quotient just below an integer could round up to it; the true quotient is
-- representable and rounding is monotonic, so floor(a / b) is the true quotient or one more. One
-- more makes q*b exceed a (a product past 2^53 rounds to at least 2^53, still above a), which
-- a - q*b < 0 detects; otherwise q*b <= a is exact. (Under round-to-nearest, rounding up needs
-- a >= 2^53 - 1, which no argument here reaches; the check keeps the helper exact regardless.)
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

-- ceil(a / b) for 0 <= a, 1 <= b, without forming a + b - 1 (bucket.ceilDiv).
local function ceil_div(a, b)
  local q = idiv(a, b)
  if q * b ~= a then -- q*b <= a: exact
    q = q + 1
  end
  return q
end

local function int(x)
  return string.format('%d', x)
end

-- Redis TIME in milliseconds, read once per script invocation: every operation of one batch.lua
-- invocation sees the same instant, as the script runs atomically (TIME would advance by
-- microseconds between its calls, within the same millisecond or the next), and a batch of a
-- hundred keys asks Redis for the time once instead of a hundred times.
local redis_now = nil
local function redis_ms()
  if not redis_now then
    local time = redis.call('TIME')
    redis_now = tonumber(time[1]) * 1000 -- seconds since 1970 * 1000 < 2^53 for another 285,000 years
      + idiv(tonumber(time[2]), 1000)
  end
  return redis_now
end
