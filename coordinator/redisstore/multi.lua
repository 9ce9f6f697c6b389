-- multi.lua: one operation on several global token buckets at once, with the arithmetic of
-- internal/bucket (State.Refill, State.Take, State.Return, Full for a missing key) and the
-- idempotency record of coordinator.OpID kept in the first bucket only. 'multi' takes the same
-- amount from every bucket, all or nothing (coordinator.TakeRequest with Also: a direct check of a
-- route with charges); 'return' hands the unspent grant of such a take back to every bucket it was
-- taken from (coordinator.ReturnRequest with Also). It touches only its KEYS, which share one Redis
-- Cluster slot (their hash tag), and makes no network call. memstore's takeAll and returnAll are
-- its twins.
--
-- KEYS     the buckets, each a hash as in bucket.lua (t, l, f, x, and c and records it leaves
--          alone); KEYS[1] also holds the calling agent's record:
--   m:<agent>  'multi': that agent's last take of several buckets: "seq granted remaining retry
--              refused now"
--   r:<agent>  'return': that agent's last Return, the record a return to KEYS[1] alone keeps
--              (bucket.lua): "seq credited remaining now"
-- ARGV     op ('multi' | 'return'), capacity, num, den, fill (KEYS[1]'s bucket.Limit),
--          multi: want, least, 1000 (no share cap) | return: amount, granted_at, 0,
--          agent ("" = not idempotent), seq, now ("" = Redis TIME),
--          record_keep, max_records, expiry_margin (coordinator constants),
--          multi: unit | return: 1, then 0, 0 (no lease handed back),
--          then for each of KEYS[2..]: capacity, num, den, fill
-- Returns  {granted, remaining, retry_after, now, flags, refused, 0, 0}; now is KEYS[1]'s clock,
--          flags 1 replayed, 2 stale (a stale operation answers KEYS[1] as stored, as bucket.lua
--          does).
--          multi: granted is what a take of want, at least least, in whole units when cut
--          (State.TakeShare), grants from a bucket holding the least any of them holds, or 0;
--          remaining the least any bucket holds afterwards; retry_after, when denied, the longest
--          among the buckets that cannot cover least (-1: never); refused, when denied, the index
--          (0-based) of the bucket of that longest retry.
--          return: granted is the sum of what every bucket was credited (State.Return of amount
--          granted at granted_at, each with its own limit: its own decay and capacity cap), at
--          most 2^53 - 1; remaining the least any bucket holds afterwards; retry_after and refused
--          0. A repeat is answered from the r: record as a return to KEYS[1] alone is.
--
-- A denied take changes no bucket but the first, which stores its refill and the record (as a
-- denied take of bucket.lua does); a grant debits the same amount from every bucket and stores
-- each; a return stores every bucket. Numbers follow bucket.lua's header: integers below 2^53, no
-- division but idiv, written with %d.
--
-- intmath.lua, common.lua and refill.lua, prepended to this script: idiv, ceil_div and int; ARGV
-- 1 and 6..17, now, rec_field, replay, take_share and sweep; added, time_for, credit, refill and
-- store_bucket.

local n = #KEYS
local MAX_EXACT = 9007199254740991 -- 2^53 - 1, bucket.MaxExact

-- The limits: KEYS[1]'s in ARGV 2..5, the others' after ARGV 17, four numbers each.
local lims = {}
for i = 1, n do
  local at = 2
  if i > 1 then
    at = 18 + (i - 2) * 4
  end
  lims[i] = {
    capacity = tonumber(ARGV[at]),
    num = tonumber(ARGV[at + 1]), -- refill: num microtokens every den ms; 0 never refills
    den = tonumber(ARGV[at + 2]),
    fill = tonumber(ARGV[at + 3]), -- ms for an empty bucket to fill; 0 when num == 0
  }
end

-- Read and refill every bucket (State.Refill); a key past its logical expiry is a full bucket
-- with no records, and a missing key is full as of now (bucket.Full).
local st = {}
local record = nil
local new_record = false -- the record written is new on a KEYS[1] that held state (common.lua's sweep)
local competes = false -- KEYS[1] holds c (bucket.lua's contention field), kept as it is
for i = 1, n do
  local k, m = KEYS[i], lims[i]
  local h
  if i == 1 then
    h = redis.call('HMGET', k, 't', 'l', 'x', 'f', 'c', rec_field or 't')
  else
    h = redis.call('HMGET', k, 't', 'l', 'x', 'f')
  end
  local tokens, last, expiry, frac = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]), tonumber(h[4]) or 0
  if i == 1 then
    competes = h[5] ~= false and h[5] ~= nil
    if rec_field then
      record = h[6]
    end
  end
  if tokens and expiry and now >= expiry then
    redis.call('DEL', k)
    tokens, last, expiry, frac = nil, nil, nil, 0
    if i == 1 then
      record, competes = nil, false
    end
  end
  if i == 1 then
    -- Idempotency (common.lua): a repeat is answered from its record, an older operation is
    -- stale; neither reads or changes the other buckets.
    local _, answer = replay(record, tokens, last)
    if answer then
      return answer
    end
    new_record = not record and tokens ~= nil and last ~= nil
  end
  if not tokens or not last then
    tokens, last, frac = m.capacity, now, 0
  end
  -- State.Refill (refill.lua): from a debt too (a cost settled after the fact on a bucket
  -- another route leases).
  tokens, last, frac = refill(m, tokens, last, frac, now)
  st[i] = {tokens = tokens, last = last, frac = frac, expiry = expiry}
end

local granted, remaining, retry, refused = 0, 0, 0, 0
local commit = n -- the buckets stored, from the first
if op == 'return' then
  -- State.Return (refill.lua) on each bucket, of its own limit: want is the amount returned,
  -- least the grant time of the take. Each credit is at most the amount (< 2^52), so the credits
  -- of 1 + coordinator.MaxAlso buckets could pass 2^53: the sum stops at 2^53 - 1, the last
  -- integer a double holds exactly (MAX_EXACT - granted is exact: granted <= MAX_EXACT).
  for i = 1, n do
    local s = st[i]
    local c
    c, s.tokens, s.frac = credit(lims[i], s.tokens, s.last, s.frac, want, least)
    if c > MAX_EXACT - granted then
      granted = MAX_EXACT
    else
      granted = granted + c
    end
    if i == 1 or s.tokens < remaining then
      remaining = s.tokens -- the least any bucket holds after its credit
    end
  end
else
  -- All or nothing: the longest retry among the buckets that cannot cover least names the
  -- refusal.
  granted = want
  local low = st[1].tokens -- the least any bucket holds
  for i = 1, n do
    local s, m = st[i], lims[i]
    low = math.min(low, s.tokens)
    if s.tokens < least then
      local r
      if least > m.capacity or m.num == 0 then
        r = NEVER
      else
        r = time_for(m, least - s.tokens, s.frac)
      end
      if granted ~= 0 or (retry ~= NEVER and (r == NEVER or r > retry)) then
        retry, refused = r, i - 1
      end
      granted = 0
    end
  end
  commit = 1 -- a denial stores the first bucket's refill and the record
  if granted > 0 then
    granted = take_share(low, want, share) -- common.lua: from a bucket holding the least of them
    commit = n -- a grant stores every bucket
    for i = 1, n do
      st[i].tokens = st[i].tokens - granted
    end
  end
  remaining = low - granted -- every bucket gave the same grant
end

-- Store (refill.lua): every bucket committed, the first with the record.
local first_expires = false
for i = 1, commit do
  local s, extra = st[i], {}
  if i == 1 and rec_field and op == 'return' then
    extra = {rec_field, string.format('%d %d %d %d', seq, granted, remaining, s.last)}
  elseif i == 1 and rec_field then
    extra = {rec_field, string.format('%d %d %d %d %d %d', seq, granted, remaining, retry, refused, s.last)}
  end
  local expires = store_bucket(KEYS[i], lims[i], s.tokens, s.last, s.frac, s.expiry, extra)
  if i == 1 then
    first_expires = expires
  end
end

-- Sweep (common.lua) of KEYS[1]: besides the records it holds t, l, f, and x and c when it has
-- them.
local fixed = 3
if first_expires then
  fixed = fixed + 1
end
if competes then
  fixed = fixed + 1
end
sweep(fixed, st[1].last, new_record)

return {granted, remaining, retry, st[1].last, 0, refused, 0, 0}
