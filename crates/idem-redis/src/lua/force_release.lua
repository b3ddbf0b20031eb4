-- No ARGV. Releases a processing record whatever its lease (an operator
-- freeing a stuck key); the attempt ends as released by an operator.
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
  redis.call('HSET', record, @state@, 'released', @owner@, '', @cur_end@, now,
    @cur_outcome@, 'released_by_operator')
  kind = 'released'
  helpers.notify()
end
local pairs = helpers.all_fields()
table.insert(pairs, 1, kind)
return pairs
