-- ARGV: generation, owner token, attempt id
local state = live_state()
if not owns(state, ARGV[1], ARGV[2]) then
  keep_evidence(ARGV[3], {kind = 'released', at_ms = now})
  return current(state)
end
local attempts = load_attempts()
end_current(attempts, {kind = 'released'})
save_attempts(attempts)
redis.call('HSET', record, 'state', 'released')
redis.call('HDEL', record, 'owner')
set_expiry(tonumber(redis.call('HGET', record, 'retention_ms')))
return {'released'}
