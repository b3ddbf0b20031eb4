-- ARGV: generation, owner token, attempt id, status, stored ('1' or '0'),
--       encoded headers, body
local state, gen, owner, watched = unpack(redis.call('HMGET', record, 'state', 'gen', 'owner', 'w'))
if state == 'processing' and gen == ARGV[1] and owner == ARGV[2] then
  -- The hot path: the caller holds the lease (the record is live, see
  -- head.lua). Retention counts from the reservation: the expiry stays
  -- as it is.
  local headers, body = ARGV[6], ARGV[7]
  if #headers <= 64 and #body <= 64 then
    redis.call('HSET', record, 'state', 'completed', 'status', ARGV[4], 'stored', ARGV[5],
      'headers', headers, 'body', body, 'cur_end', string.format('%d', now),
      'cur_outcome', 'completed')
  else
    -- Too long for the compact encoding: the response gets a key of its own.
    redis.call('SET', record .. ':r', headers .. body, 'PXAT', redis.call('HGET', record, 'expires'))
    redis.call('HSET', record, 'state', 'completed', 'status', ARGV[4], 'stored', ARGV[5],
      'split', string.format('%d', #headers), 'cur_end', string.format('%d', now),
      'cur_outcome', 'completed')
  end
  if watched and NOTIFY then
    redis.call('PUBLISH', record .. ':c', '1')
  end
  return {'recorded'}
end
--@common
--@fence
return fenced('completed', ARGV[4], state, redis.call('HGET', record, 'expires'), gen)
