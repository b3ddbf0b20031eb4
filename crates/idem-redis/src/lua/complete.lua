-- ARGV: generation, owner token, attempt id, status, stored ('1' or '0'),
--       encoded headers, body
local gen, token, attempt_id = ARGV[1], ARGV[2], ARGV[3]
local status = tonumber(ARGV[4])
local state = live_state()
if not owns(state, gen, token) then
  keep_evidence(attempt_id, {kind = 'completed', status = status, at_ms = now})
  return current(state)
end
local attempts = load_attempts()
end_current(attempts, {kind = 'completed', status = status})
save_attempts(attempts)
redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
  'headers', ARGV[6], 'body', ARGV[7], 'completed', now)
redis.call('HDEL', record, 'owner')
set_expiry(tonumber(redis.call('HGET', record, 'retention_ms')))
return {'recorded'}
