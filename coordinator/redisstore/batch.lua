-- batch.lua: several bucket.lua calls in one EVAL on a standalone Redis, so that a batch's takes
-- and returns cost Redis one command instead of one per key (its reading, dispatch and reply; the
-- work on each key is the same). redisstore.go wraps bucket.lua, with
-- common.lua and refill.lua, in a function one(KEYS, ARGV) placed before this text; each call
-- runs exactly as bucket.lua would on its own, one after another, the script atomic as a whole.
--
-- KEYS[i]  the i-th call's bucket
-- ARGV     the calls' bucket.lua arguments one after another, as many to each (bucket.lua's
--          arguments have a fixed count)
-- Returns  one answer per key, in order: bucket.lua's reply, or an error reply where the call
--          raised an error (what it wrote before the error stays, as it would for a script of its
--          own)
local arity = #KEYS > 0 and #ARGV / #KEYS or 0
if arity < 1 or arity % 1 ~= 0 then
  return redis.error_reply(string.format('ERR batch: %d arguments for %d keys', #ARGV, #KEYS))
end
local out = {}
for i = 1, #KEYS do
  local base = (i - 1) * arity
  local ok, r = pcall(one, {KEYS[i]}, {unpack(ARGV, base + 1, base + arity)})
  if ok then
    out[i] = r
  elseif type(r) == 'table' and r.err then
    out[i] = r
  else
    out[i] = redis.error_reply(tostring(r))
  end
end
return out
