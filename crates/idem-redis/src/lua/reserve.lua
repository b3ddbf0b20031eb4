-- ARGV: fingerprint, attempt id, owner token, lease ms, retention ms,
--       tenant, operation, key, attempt history size
local fp, attempt_id, token = ARGV[1], ARGV[2], ARGV[3]
local lease_ms, retention_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local history = tonumber(ARGV[9])

local function start(gen, attempts)
  table.insert(attempts, {
    id = attempt_id, generation = gen, started_at_ms = now,
    ended_at_ms = cjson.null, outcome = {kind = 'running'}, late = cjson.null,
  })
  while #attempts > history do
    table.remove(attempts, 1)
  end
  redis.call('HSET', record,
    'fp', fp, 'state', 'processing', 'gen', gen, 'owner', token,
    'lease_until', now + lease_ms, 'lease_ms', lease_ms, 'retention_ms', retention_ms)
  redis.call('HDEL', record, 'status', 'stored', 'headers', 'body', 'completed')
  save_attempts(attempts)
  set_expiry(retention_ms)
  return gen
end

local state = live_state()
if not state then
  redis.call('HSET', record, 'tenant', ARGV[6], 'op', ARGV[7], 'key', ARGV[8], 'created', now)
  return {'acquired', start(1, {})}
end
local gen = tonumber(redis.call('HGET', record, 'gen'))
if state == 'released' then
  return {'acquired', start(gen + 1, load_attempts())}
end
if redis.call('HGET', record, 'fp') ~= fp then
  return {'conflict'}
end
if state == 'processing' then
  local lease_until = tonumber(redis.call('HGET', record, 'lease_until'))
  if lease_until > now then
    return {'in_progress', lease_until - now}
  end
  local attempts = load_attempts()
  local superseded = end_current(attempts, {kind = 'superseded'})
  local encoded = cjson.encode(superseded or cjson.null)
  return {'taken_over', start(gen + 1, attempts), encoded}
end
return current(state)
