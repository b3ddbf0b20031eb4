-- ARGV: generation, owner token, lease ms, or 'unknown' in its place: the
-- running attempt's caller was told its outcome is unknown, which the history
-- keeps (machine.rs, mark_unknown), and the lease stays as it is.
expand()
local state, expires, gen, owner = unpack(redis.call('HMGET', record, @state@, @expires@, @gen@, @owner@))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  return rare().current(state)
end
if ARGV[3] == 'unknown' then
  if redis.call('HGET', record, @cur_outcome@) == 'running' then
    redis.call('HSET', record, @cur_outcome@, 'unknown')
  end
  return {'renewed'}
end
local lease_until = now + tonumber(ARGV[3])
local until_text = ms(lease_until)
redis.call('HSET', record, @lease_until@, until_text, @lease_ms@, ARGV[3])
if lease_until > tonumber(expires) then
  -- A request that runs longer than the retention never expires under its feet.
  redis.call('HSET', record, @expires@, until_text)
  redis.call('PEXPIREAT', record, until_text)
end
return {'renewed'}
