-- No ARGV. Answers the outcome and the record after it, as HGETALL pairs.
local state = live_state()
if not state then
  return {'not_found'}
end
if state == 'completed' then
  return {'already_completed', redis.call('HGETALL', record)}
end
if state == 'cancelled' then
  return {'already_cancelled', redis.call('HGETALL', record)}
end
local attempts = load_attempts()
end_current(attempts, {kind = 'cancelled'})
save_attempts(attempts)
redis.call('HSET', record, 'state', 'cancelled')
redis.call('HDEL', record, 'owner')
set_expiry(tonumber(redis.call('HGET', record, 'retention_ms')))
return {'cancelled', redis.call('HGETALL', record)}
