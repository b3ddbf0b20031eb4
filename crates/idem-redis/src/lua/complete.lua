-- ARGV: generation, owner token, attempt id, status, stored ('1' or '0'),
--       encoded headers, body, notify ('1' to publish)
local status = ARGV[4]
local reply, expires, watched = fenced('completed', status)
if reply then
  return reply
end
-- Retention counts from the reservation: the expiry stays as it is.
local headers, body = ARGV[6], ARGV[7]
if #headers <= 64 and #body <= 64 then
  redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
    'headers', headers, 'body', body, 'cur_end', ms(now), 'cur_outcome', 'completed')
else
  -- Too long for the compact encoding: the response gets a key of its own.
  redis.call('SET', response_key, headers .. body, 'PXAT', expires)
  redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
    'split', ms(#headers), 'cur_end', ms(now), 'cur_outcome', 'completed')
end
if watched then
  rare().notify(ARGV[8])
end
return {'recorded'}
