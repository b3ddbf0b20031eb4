-- No ARGV. Answers which side won and the record after it, as HGETALL pairs.
local state, expires, retention_ms, outcome =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'retention_ms', 'cur_outcome'))
if not live(state, expires) then
  return {'not_found'}
end
if state == 'completed' then
  return {'already_completed', redis.call('HGETALL', record)}
end
if state == 'cancelled' then
  return {'already_cancelled', redis.call('HGETALL', record)}
end
local until_ms = now + tonumber(retention_ms)
redis.call('HSET', record, 'state', 'cancelled', 'owner', '', 'updated', now, 'expires', until_ms)
if outcome == 'running' then
  redis.call('HSET', record, 'cur_outcome', 'cancelled', 'cur_end', now)
end
redis.call('PEXPIREAT', record, until_ms)
return {'cancelled', redis.call('HGETALL', record)}
