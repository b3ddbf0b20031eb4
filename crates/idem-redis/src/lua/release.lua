-- ARGV: generation, owner token, attempt id, notify ('1' to publish)
local reply, _, watched = fenced('released', '')
if reply then
  return reply
end
redis.call('HSET', record, 'state', 'released', 'cur_end', ms(now),
  'cur_outcome', 'released')
if watched then
  rare().notify(ARGV[4])
end
return {'released'}
