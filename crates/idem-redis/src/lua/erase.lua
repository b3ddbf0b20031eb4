-- ARGV (optional): the erasures channel, the scope's hex. Erases a live record that is not processing (an operator's
-- erasure for data protection, or of a 4xx stored by mistake): its key is
-- new afterwards. A processing record is left as it is: erasing it would
-- let a retry run while its attempt may still act. Answers the kind
-- ('erased', 'processing' or 'not_found') followed by the record as
-- HGETALL pairs (as it was, for an erased one).
expand()
local state, expires = unpack(redis.call('HMGET', record, @state@, @expires@))
if not live(state, expires) then
  return {'not_found'}
end
local helpers = rare()
local pairs = helpers.all_fields()
local kind = 'processing'
if state ~= 'processing' then
  redis.call('DEL', record, response_key)
  kind = 'erased'
  helpers.notify()
  if NOTIFY and ARGV[1] then
    -- Every process's replay cache forgets it (erasures.rs).
    redis.call('PUBLISH', ARGV[1], ARGV[2])
  end
end
table.insert(pairs, 1, kind)
return pairs
