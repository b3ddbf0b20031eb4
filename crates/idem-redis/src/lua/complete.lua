-- ARGV: generation, owner token, attempt id, status, stored ('1' or '0'),
--       encoded headers, body, notify ('1' to publish)
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
local headers, body = ARGV[6], ARGV[7]
if #headers <= 64 and #body <= 64 then
  redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
    'headers', headers, 'body', body, 'owner', '', 'cur_end', now, 'cur_outcome', 'completed')
else
  -- Too long for the compact encoding: the response gets a key of its own.
  redis.call('SET', response_key, headers .. body, 'PXAT', expires)
  redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
    'split', #headers, 'owner', '', 'cur_end', now, 'cur_outcome', 'completed')
end
notify(ARGV[8])
return {'recorded'}
