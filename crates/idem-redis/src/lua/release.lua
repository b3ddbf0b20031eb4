-- ARGV: generation, owner token, attempt id
local state, expires, gen, owner, watched =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner', 'w'))
if state == 'processing' and gen == ARGV[1] and owner == ARGV[2]
    and tonumber(expires) > now then
  -- The hot path: the caller holds the lease.
  redis.call('HSET', record, 'state', 'released', 'cur_end', string.format('%d', now),
    'cur_outcome', 'released')
  if watched and NOTIFY then
    redis.call('PUBLISH', record .. ':c', '1')
  end
  return {'released'}
end
--@common
--@fence
return fenced('released', '', state, expires, gen)
