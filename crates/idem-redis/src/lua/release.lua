-- ARGV: generation, owner token, attempt id
local state, expires, gen, owner, retention_ms =
  unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner', 'retention_ms'))
if not live(state, expires) then
  return {'vacant'}
end
if state ~= 'processing' or gen ~= ARGV[1] or owner ~= ARGV[2] then
  local cur_id, cur_outcome = unpack(redis.call('HMGET', record, 'cur_id', 'cur_outcome'))
  if state == 'released' and gen == ARGV[1] and cur_id == ARGV[3] and cur_outcome == 'released' then
    -- A retry of this very release whose reply was lost.
    return {'released'}
  end
  keep_evidence(ARGV[3], 'released::' .. now)
  return current(state)
end
local until_ms = now + tonumber(retention_ms)
redis.call('HSET', record, 'state', 'released', 'owner', '', 'cur_end', now,
  'cur_outcome', 'released', 'updated', now, 'expires', until_ms)
redis.call('PEXPIREAT', record, until_ms)
return {'released'}
