-- ARGV: generation, owner token, attempt id, notify ('1' to publish)
local state, expires, gen, owner =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner'))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  local cur_id, cur_outcome = unpack(redis.call('HMGET', record, 'cur_id', 'cur_outcome'))
  if state == 'released' and gen == ARGV[1] and cur_id == ARGV[3] and cur_outcome == 'released' then
    -- A retry of this very release whose reply was lost.
    return {'released'}
  end
  local helpers = rare()
  helpers.keep_evidence(ARGV[3], 'released::' .. now)
  return helpers.current(state)
end
redis.call('HSET', record, 'state', 'released', 'owner', '', 'cur_end', now,
  'cur_outcome', 'released')
notify(ARGV[4])
return {'released'}
