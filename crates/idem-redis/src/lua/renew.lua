-- ARGV: generation, owner token, lease ms
local state, expires, gen, owner = unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner'))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  return current(state)
end
local lease_ms = tonumber(ARGV[3])
redis.call('HSET', record, 'lease_until', now + lease_ms, 'lease_ms', lease_ms)
return {'renewed'}
