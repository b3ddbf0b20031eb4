-- ARGV: the cancel request's id (the same when a call is retried).
-- Answers which side won and the record after it, as HGETALL pairs.
expand()
local state, expires, retention_ms, outcome, cancel_id = unpack(redis.call('HMGET', record,
  @state@, @expires@, @retention_ms@, @cur_outcome@, @cancel_id@))
-- A released record is vacant: nothing runs, nothing to cancel.
if not live(state, expires) or state == 'released' then
  return {'not_found'}
end
if state == 'completed' then
  return {'already_completed', rare().all_fields()}
end
if state == 'cancelled' then
  if cancel_id == ARGV[1] then
    -- A retry of this very cancel whose reply was lost.
    return {'cancelled', rare().all_fields()}
  end
  return {'already_cancelled', rare().all_fields()}
end
local until_ms = now + tonumber(retention_ms)
redis.call('HSET', record, @state@, 'cancelled', @owner@, '', @expires@, until_ms,
  @cancel_id@, ARGV[1])
if outcome == 'running' or outcome == 'unknown' then
  redis.call('HSET', record, @cur_outcome@, 'cancelled', @cur_end@, now)
end
redis.call('PEXPIREAT', record, until_ms)
local helpers = rare()
helpers.notify()
return {'cancelled', helpers.all_fields()}
