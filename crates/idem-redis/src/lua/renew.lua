-- ARGV: generation, owner token, lease ms
local state, expires, gen, owner = unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner'))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  return rare().current(state)
end
local lease_ms = tonumber(ARGV[3])
local lease_until = now + lease_ms
redis.call('HSET', record, 'lease_until', lease_until, 'lease_ms', lease_ms)
if lease_until > tonumber(expires) then
  -- A request that runs longer than the retention never expires under its feet.
  redis.call('HSET', record, 'expires', lease_until)
  redis.call('PEXPIREAT', record, lease_until)
end
return {'renewed'}
