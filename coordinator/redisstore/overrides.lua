-- overrides.lua: one read of, or one change to, the runtime overrides (coordinator.OverridesStore).
-- It touches KEYS[1] only and makes no network call. Reads go through the script too: a Cluster
-- client routes a script by its key without asking Redis for command metadata (COMMAND), which
-- the coordinator's ACL user is not allowed.
--
-- KEYS[1]  the overrides: a hash of "<rule>|<tenant>" → spec (rule names have no '|'), and
--   #epoch  Redis TIME (seconds.microseconds) when the hash was created, so a hash created anew
--           (after a flush or a failover that lost it) never repeats an old stamp
--   #rev    the number of changes
--   #bytes  the sum over the overrides of len(rule) + len(tenant) + len(spec)
-- ARGV     op ("stamp" | "load" | "put" | "delete"), field, spec (put), max_count, max_bytes (put)
-- Returns  stamp: {epoch or '', rev or ''}; load: HGETALL of the hash;
--          put, delete: {status, previous spec or '', stamp "<epoch>:<rev>" or ''};
--          status "ok", "same" (put of the spec held: nothing changed), "full" (put past the
--          bounds: nothing changed) or "missing" (delete of no override: nothing changed)

local key = KEYS[1]
local op = ARGV[1]

if op == 'stamp' then
  local m = redis.call('HMGET', key, '#epoch', '#rev')
  return {m[1] or '', m[2] or ''}
elseif op == 'load' then
  return redis.call('HGETALL', key)
end

local field = ARGV[2]

local m = redis.call('HMGET', key, field, '#rev', '#bytes', '#epoch')
local old, rev, bytes, epoch = m[1], tonumber(m[2]) or 0, tonumber(m[3]) or 0, m[4]

local function stamp()
  if not epoch then
    return ''
  end
  return epoch .. ':' .. string.format('%d', rev)
end

-- what an override counts against max_bytes: the field holds rule, '|' and tenant
local function size(spec)
  return #field - 1 + #spec
end

if op == 'delete' then
  if not old then
    return {'missing', '', stamp()}
  end
  rev = rev + 1
  redis.call('HDEL', key, field)
  redis.call('HSET', key, '#rev', string.format('%d', rev), '#bytes', string.format('%d', bytes - size(old)))
  return {'ok', old, stamp()}
end

local spec = ARGV[3]
local max_count = tonumber(ARGV[4])
local max_bytes = tonumber(ARGV[5])
if old == spec then
  return {'same', old, stamp()}
end
local count = 0
if epoch then
  count = redis.call('HLEN', key) - 3 -- #epoch, #rev, #bytes
end
local new_bytes = bytes + size(spec)
if old then
  new_bytes = new_bytes - size(old)
end
if (not old and count + 1 > max_count) or new_bytes > max_bytes then
  return {'full', old or '', stamp()}
end
if not epoch then
  local time = redis.call('TIME')
  epoch = time[1] .. '.' .. time[2]
end
rev = rev + 1
redis.call('HSET', key, field, spec, '#rev', string.format('%d', rev), '#bytes', string.format('%d', new_bytes), '#epoch', epoch)
return {'ok', old or '', stamp()}
