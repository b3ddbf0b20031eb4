-- ARGV: generation, owner token, attempt id, status, stored ('1' or '0'),
--       encoded headers, body
local status = ARGV[4]
local state, expires, gen, owner =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner'))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  local cur_id, cur_outcome = unpack(redis.call('HMGET', record, 'cur_id', 'cur_outcome'))
  if state == 'completed' and gen == ARGV[1] and cur_id == ARGV[3] and cur_outcome == 'completed' then
    -- A retry of this very completion whose reply was lost.
    return {'recorded'}
  end
  local helpers = rare()
  helpers.keep_evidence(ARGV[3], 'completed:' .. status .. ':' .. now)
  return helpers.current(state)
end
-- Retention counts from the reservation: the expiry stays as it is.
redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
  'headers', ARGV[6], 'body', ARGV[7], 'completed', now, 'owner', '',
  'cur_end', now, 'cur_outcome', 'completed', 'cur_status', status, 'updated', now)
return {'recorded'}
