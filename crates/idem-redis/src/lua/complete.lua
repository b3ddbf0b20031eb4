-- ARGV: generation, owner token, attempt id, status, stored ('1' or '0'),
--       encoded headers, body
local status = ARGV[4]
local state, expires, gen, owner, retention_ms =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner', 'retention_ms'))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  local cur_id, cur_outcome = unpack(redis.call('HMGET', record, 'cur_id', 'cur_outcome'))
  if state == 'completed' and gen == ARGV[1] and cur_id == ARGV[3] and cur_outcome == 'completed' then
    -- A retry of this very completion whose reply was lost.
    return {'recorded'}
  end
  keep_evidence(ARGV[3], 'completed:' .. status .. ':' .. now)
  return current(state)
end
local until_ms = now + tonumber(retention_ms)
redis.call('HSET', record, 'state', 'completed', 'status', status, 'stored', ARGV[5],
  'headers', ARGV[6], 'body', ARGV[7], 'completed', now, 'owner', '',
  'cur_end', now, 'cur_outcome', 'completed', 'cur_status', status,
  'updated', now, 'expires', until_ms)
redis.call('PEXPIREAT', record, until_ms)
return {'recorded'}
