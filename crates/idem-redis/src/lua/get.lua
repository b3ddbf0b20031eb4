-- No ARGV. The live record as HGETALL pairs, or an empty list.
if not live_state() then
  return {}
end
return redis.call('HGETALL', record)
