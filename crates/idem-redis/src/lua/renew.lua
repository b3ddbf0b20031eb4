-- ARGV: generation, owner token, lease ms
local state = live_state()
if not owns(state, ARGV[1], ARGV[2]) then
  return current(state)
end
local lease_ms = tonumber(ARGV[3])
redis.call('HSET', record, 'lease_until', now + lease_ms, 'lease_ms', lease_ms)
return {'renewed'}
