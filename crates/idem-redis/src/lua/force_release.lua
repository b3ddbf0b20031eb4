-- No ARGV. Releases a processing record whatever its lease (an operator
-- freeing a stuck key); an attempt still open ends as released by an operator.
-- Answers the kind ('released', 'not_processing' or 'not_found') followed
-- by the record as HGETALL pairs.
expand()
local state, expires = unpack(redis.call('HMGET', record, @state@, @expires@))
if not live(state, expires) then
  return {'not_found'}
end
local kind = 'not_processing'
local helpers = rare()
if state == 'processing' then
  redis.call('HSET', record, @state@, 'released', @owner@, '')
  -- Only an attempt that has not ended is ended by the operator (one a
  -- release after a takeover ended keeps its outcome: machine.rs).
  local outcome = redis.call('HGET', record, @cur_outcome@)
  if outcome == 'running' or outcome == 'unknown' then
    redis.call('HSET', record, @cur_end@, now, @cur_outcome@, 'released_by_operator')
  end
  kind = 'released'
  helpers.notify()
end
local pairs = helpers.all_fields()
table.insert(pairs, 1, kind)
return pairs
