-- ARGV: generation, owner token, attempt id
local state, gen, owner, watched =
  unpack(redis.call('HMGET', record, 'state', 'gen', 'owner', 'w'))
if state == 'processing' and gen == ARGV[1] and owner == ARGV[2] then
  -- The hot path: the caller holds the lease (the record is live, see
  -- head.lua).
  redis.call('HSET', record, 'state', 'released', 'cur_end', string.format('%d', now),
    'cur_outcome', 'released')
  if watched and NOTIFY then
    redis.call('PUBLISH', record .. ':c', '1')
  end
  return {'released'}
end
--@common
--@fence
return fenced('released', '', state, redis.call('HGET', record, 'expires'), gen)
