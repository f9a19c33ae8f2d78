"""The Lua scripts behind the shared fair order (fairness_redis.py), one per step, each run
atomically by Redis. Keys live under one per-model prefix (``KEYS[1]``, one hash slot); the
layout is told in fairness_redis.py's docstring."""

from __future__ import annotations

COMMON = """
local P = KEYS[1]
local NCLS = 3
local function num(x) return tonumber(x) or 0 end
local function untag(eid, e)
  local tags = P .. 'tags' .. e.klass
  if num(redis.call('HGET', tags, e.tenant)) == num(e.finish) then redis.call('HSET', tags, e.tenant, e.start) end
end
local function entry(eid)
  local v = redis.call('HMGET', P .. 'e:' .. eid, 'tenant', 'klass', 'start', 'finish', 'status', 'worker', 'quiet',
                       'cost')
  if not v[1] then return nil end
  return {tenant = v[1], klass = v[2], start = v[3], finish = v[4], status = v[5], worker = v[6], quiet = v[7],
          cost = num(v[8])}
end
local function unqueue(eid, e)
  redis.call('ZREM', P .. 'q' .. e.klass, eid)
  redis.call('ZREM', P .. 'a' .. e.klass, eid)
  redis.call('ZREM', P .. 'tq' .. e.klass .. ':' .. e.tenant, eid)
  if redis.call('HINCRBY', P .. 'pt', e.tenant, -1) <= 0 then redis.call('HDEL', P .. 'pt', e.tenant) end
  local inclass = P .. 'pt' .. e.klass
  if redis.call('HINCRBY', inclass, e.tenant, -1) <= 0 then redis.call('HDEL', inclass, e.tenant) end
  redis.call('DECR', P .. 'n')
  redis.call('HINCRBYFLOAT', P .. 'qc', e.klass, -e.cost)
  local costs = P .. 'ptc' .. e.klass
  if num(redis.call('HGET', inclass, e.tenant)) <= 0 then redis.call('HDEL', costs, e.tenant)
  else redis.call('HINCRBYFLOAT', costs, e.tenant, -e.cost) end
end
local function enqueue(eid, tenant, klass, start, now, cost)
  redis.call('ZADD', P .. 'q' .. klass, start, eid)
  redis.call('ZADD', P .. 'a' .. klass, now, eid)  -- when it joined its class (promotion counts from here)
  redis.call('ZADD', P .. 'tq' .. klass .. ':' .. tenant, start, eid)
  redis.call('HINCRBY', P .. 'pt', tenant, 1)
  redis.call('HINCRBY', P .. 'pt' .. klass, tenant, 1)
  redis.call('INCR', P .. 'n')
  redis.call('HINCRBYFLOAT', P .. 'qc', klass, cost)  -- the cost queued in the class, for the wait estimate
  redis.call('HINCRBYFLOAT', P .. 'ptc' .. klass, tenant, cost)  -- and each tenant's part of it
end
-- Throughput: the cost of the requests served, in one-second buckets over the last WINDOW s, one hash per
-- meter (fields c<sec>: cost, n<sec>: requests; it expires with the window): the model's (P .. 'tp') and
-- each tenant's (P .. 'ts:' .. tenant).
local WINDOW, MIN_SAMPLES = 30, 4
local function count(key, sec, cost)
  redis.call('HINCRBYFLOAT', key, 'c' .. sec, cost)
  redis.call('HINCRBY', key, 'n' .. sec, 1)
  for _, f in ipairs(redis.call('HKEYS', key)) do
    if tonumber(string.sub(f, 2)) <= sec - WINDOW then redis.call('HDEL', key, f) end
  end
  redis.call('PEXPIRE', key, WINDOW * 1000)
end
local function served(now, cost, tenant)
  local sec = math.floor(now / 1000)
  count(P .. 'tp', sec, cost)
  count(P .. 'ts:' .. tenant, sec, cost)
end
local function rate(now, key)  -- cost per second and a request's mean cost; 0 until MIN_SAMPLES finished
  key = key or P .. 'tp'
  local window, n, sum, oldest = math.floor(now / 1000) - WINDOW, 0, 0, nil
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local sec = tonumber(string.sub(fields[i], 2))
    if string.sub(fields[i], 1, 1) == 'n' and sec > window then
      n, sum = n + tonumber(fields[i + 1]), sum + num(redis.call('HGET', key, 'c' .. sec))
      if not oldest or sec < oldest then oldest = sec end
    end
  end
  if n < MIN_SAMPLES then return 0, 0 end
  return sum / math.max(now / 1000 - oldest, 1), sum / n
end
local function back_of(now, klass)  -- a refused request's wait, were it at the back of ``klass``; -1: unknown
  local per_s, mean = rate(now)
  if per_s <= 0 then return -1 end
  local ahead = 0
  for k = klass, NCLS - 1 do ahead = ahead + math.max(0, num(redis.call('HGET', P .. 'qc', k))) end
  return (ahead + mean) / per_s
end
local function finish(eid, e, status)
  -- an entry leaves: the owner reads the status once, then it goes
  redis.call('SREM', P .. 'w:' .. e.worker, eid)
  redis.call('HSET', P .. 'e:' .. eid, 'status', status)
  redis.call('PEXPIRE', P .. 'e:' .. eid, 60000)
end
local function reap(now)
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', P .. 'alive', '-inf', '(' .. now)) do
    for _, eid in ipairs(redis.call('SMEMBERS', P .. 'w:' .. w)) do
      local e = entry(eid)
      if e and e.status == 'queued' then unqueue(eid, e); untag(eid, e)
      elseif e and e.status == 'released' then redis.call('HINCRBY', P .. 'inf', e.klass, -1) end
      redis.call('DEL', P .. 'e:' .. eid)
    end
    redis.call('DEL', P .. 'w:' .. w)
    redis.call('ZREM', P .. 'alive', w)
  end
end
local function beat(now, worker, ttl)
  redis.call('ZADD', P .. 'alive', now + ttl, worker)
  reap(now)
end
"""

# ARGV: now, worker, ttl, tenant, klass, cost, weight, burst, max per tenant, max queued, free (this worker's
# view), total
ENTER = COMMON + """
local now, worker, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local tenant, klass, cost, weight = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local burst, per_tenant, max_queued = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
beat(now, worker, ttl)
-- slots free now (as RELEASE counts them) take queued entries at the next release: those do not wait, so
-- they do not count against the bound (a burst's entries all entering before any release filled it)
local busy = 0
for k = 0, NCLS - 1 do busy = busy + num(redis.call('HGET', P .. 'inf', k)) end
local free_now = math.max(0, math.min(tonumber(ARGV[11]) or 0, (tonumber(ARGV[12]) or 0) - busy))
local eid = string.format('%016d', redis.call('INCR', P .. 'seq'))
local victim, why, full = '', 'preempted', nil
if num(redis.call('HGET', P .. 'pt', tenant)) >= per_tenant then
  full = 'tenant_queue_full'
  for k = 0, klass - 1 do  -- the tenant's own lower classes, lowest first: its last there gives way
    victim = redis.call('ZRANGE', P .. 'tq' .. k .. ':' .. tenant, -1, -1)[1] or ''
    if victim ~= '' then break end
  end
elseif num(redis.call('GET', P .. 'n')) - free_now >= max_queued then
  full = 'queue_full'
  for k = 0, klass - 1 do  -- a lower class, lowest first: the last in its fair order gives way
    local last = redis.call('ZRANGE', P .. 'q' .. k, -1, -1)
    if #last > 0 then victim = last[1]; break end
  end
  if victim == '' then  -- the same class: the longest queue's newest gives way to a shorter one
    local counts, longest, most = redis.call('HGETALL', P .. 'pt' .. klass), nil, 0
    for i = 1, #counts, 2 do
      if tonumber(counts[i + 1]) > most then longest, most = counts[i], tonumber(counts[i + 1]) end
    end
    if longest and longest ~= tenant
        and num(redis.call('HGET', P .. 'pt', longest)) > num(redis.call('HGET', P .. 'pt', tenant)) + 1 then
      victim, why = redis.call('ZRANGE', P .. 'tq' .. klass .. ':' .. longest, -1, -1)[1], 'shed'
    end
  end
end
if full then  -- a refusal's Retry-After: its wait by the estimate (the victim's kept for its worker to read)
  if victim == '' then return {eid, full, '', tostring(back_of(now, klass))} end
  local v = entry(victim)
  unqueue(victim, v); untag(victim, v); finish(victim, v, why)
  redis.call('HSET', P .. 'e:' .. victim, 'wait', back_of(now, tonumber(v.klass)))
end
local tags = P .. 'tags' .. klass
local vt = num(redis.call('HGET', P .. 'vt', klass))
local start = math.max(vt - burst / weight, num(redis.call('HGET', tags, tenant)))
local fin = start + cost / weight
redis.call('HSET', tags, tenant, fin)
local quiet = num(redis.call('HGET', P .. 'pt' .. klass, tenant)) == 0 and '1' or '0'
redis.call('HSET', P .. 'e:' .. eid, 'tenant', tenant, 'klass', klass, 'start', start, 'finish', fin,
           'status', 'queued', 'worker', worker, 'quiet', quiet, 'cost', cost, 'weight', weight)
enqueue(eid, tenant, klass, start, now, cost)
redis.call('SADD', P .. 'w:' .. worker, eid)
-- its wait by the estimate: the cost queued ahead of it (higher classes, and its own class before it in
-- fair order, at that class's mean queued cost) plus one request's, over the measured throughput
local per_s, mean = rate(now)
local wait = -1
if per_s > 0 then
  local ahead = 0
  for k = klass + 1, NCLS - 1 do ahead = ahead + math.max(0, num(redis.call('HGET', P .. 'qc', k))) end
  local others = redis.call('ZCARD', P .. 'q' .. klass) - 1
  if others > 0 then
    local before = redis.call('ZCOUNT', P .. 'q' .. klass, '-inf', '(' .. start)
    ahead = ahead + before * math.max(0, num(redis.call('HGET', P .. 'qc', klass)) - cost) / others
  end
  wait = (ahead + mean) / per_s
  -- at least its own tenant's cost ahead of it (every earlier entry of the tenant in the class) over what
  -- that tenant is being served at: a backlogged tenant gets its share, not the model's throughput
  local mine = num(redis.call('HGET', P .. 'ptc' .. klass, tenant)) - cost
  if mine > 0.5 then  -- (not a float sum's residue)
    local own = rate(now, P .. 'ts:' .. tenant)
    if own > 0 then wait = math.max(wait, (mine + cost) / own) end
  end
end
return {eid, 'queued', victim, tostring(wait)}
"""

# ARGV: now, worker, ttl, free (this worker's view), total, quiet share, reserved share per class
RELEASE = COMMON + """
local now, worker, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local free, total, quiet = tonumber(ARGV[4]), tonumber(ARGV[5]), math.floor(tonumber(ARGV[6]) * tonumber(ARGV[5]))
beat(now, worker, ttl)
local inf, busy = {}, 0
for k = 0, NCLS - 1 do inf[k] = num(redis.call('HGET', P .. 'inf', k)); busy = busy + inf[k] end
free = math.min(free, total - busy)
local out = {}
while free > 0 do
  local unused, held = {}, 0
  for k = 0, NCLS - 1 do
    unused[k] = math.max(0, math.floor(tonumber(ARGV[7 + k]) * total) - inf[k]); held = held + unused[k]
  end
  local taken = false
  for k = NCLS - 1, 0, -1 do
    local head = redis.call('ZRANGE', P .. 'q' .. k, 0, 0)
    if #head > 0 then
      local e = entry(head[1])
      if free - (held - unused[k]) - (e.quiet == '1' and 0 or quiet) > 0 then
        unqueue(head[1], e)
        redis.call('HSET', P .. 'vt', k, math.max(num(redis.call('HGET', P .. 'vt', k)), num(e.start)))
        redis.call('HSET', P .. 'e:' .. head[1], 'status', 'released')
        redis.call('HINCRBY', P .. 'inf', k, 1)
        inf[k] = inf[k] + 1
        out[#out + 1] = head[1]
        free = free - 1
        taken = true
        break
      end
    end
  end
  if not taken then break end
end
if #out > 0 then redis.call('PUBLISH', P .. 'wake', #out) end
return out
"""

# ARGV: eid, why (the status a queued entry leaves with), now, '1' when it was served (its cost counts in the
# throughput), '1' when it leaves only if still queued. Returns the status it had.
LEAVE = COMMON + """
local eid, why, now, was_served, only_queued = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local e = entry(eid)
if not e then return '' end
if only_queued == '1' and e.status ~= 'queued' then return e.status end
if e.status == 'queued' then unqueue(eid, e); untag(eid, e)
elseif e.status == 'released' then
  redis.call('HINCRBY', P .. 'inf', e.klass, -1)
  if was_served == '1' then served(now, e.cost, e.tenant) end
end
if e.status == 'queued' or e.status == 'released' then redis.call('PUBLISH', P .. 'wake', 0) end
redis.call('SREM', P .. 'w:' .. e.worker, eid)
redis.call('DEL', P .. 'e:' .. eid)
return e.status
"""

# ARGV: now, worker, ttl, then per class but the highest: ms in the class before promotion (-1: never)
PROMOTE = COMMON + """
local now, worker, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
beat(now, worker, ttl)
local moved = {}
for k = 0, NCLS - 2 do
  local limit, up = tonumber(ARGV[4 + k]), k + 1
  if limit >= 0 then
    for _, eid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'a' .. k, '-inf', now - limit)) do
      local e = entry(eid)
      local weight = num(redis.call('HGET', P .. 'e:' .. eid, 'weight'))
      unqueue(eid, e)
      local start = num(redis.call('HGET', P .. 'vt', up))  -- at the front of the fair order: it waited long enough
      local fin = start + e.cost / weight
      local tags = P .. 'tags' .. up
      redis.call('HSET', tags, e.tenant, math.max(num(redis.call('HGET', tags, e.tenant)), fin))
      redis.call('HSET', P .. 'e:' .. eid, 'klass', up, 'start', start, 'finish', fin)
      enqueue(eid, e.tenant, up, start, now, e.cost)
      moved[#moved + 1] = eid
    end
  end
end
return moved
"""

BEAT = COMMON + """
beat(tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]))
return 1
"""
