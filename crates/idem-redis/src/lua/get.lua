-- No ARGV. The live record as HGETALL pairs, or an empty list.
local state, expires = unpack(redis.call('HMGET', record, 'state', 'expires'))
if not live(state, expires) then
  return {}
end
return rare().all_fields()
