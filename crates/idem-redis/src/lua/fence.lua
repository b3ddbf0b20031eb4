-- The fence of complete and release (prefixed to those two scripts only).
-- `fenced(outcome, status)` answers nil, the record's expiry and its
-- watched mark (see watch.lua) while the caller (ARGV: generation, owner
-- token, attempt id) holds the lease;
-- else the reply: vacant, the retry of this very outcome whose reply was
-- lost, or the record's state now, the attempt's outcome kept as late
-- evidence ('completed:201:<ms>', 'released::<ms>').
local function fenced(outcome, status)
  local state, expires, gen, owner, watched =
    unpack(redis.call('HMGET', record, 'state', 'expires', 'gen', 'owner', 'w'))
  if not live(state, expires) then
    return {'vacant'}
  end
  if state == 'processing' and gen == ARGV[1] and owner == ARGV[2] then
    return nil, expires, watched
  end
  local cur_id, cur_outcome = unpack(redis.call('HMGET', record, 'cur_id', 'cur_outcome'))
  if state == outcome and gen == ARGV[1] and cur_id == ARGV[3] and cur_outcome == outcome then
    -- A retry of this very outcome whose reply was lost.
    if outcome == 'completed' then
      return {'recorded'}
    end
    return {outcome}
  end
  local helpers = rare()
  helpers.keep_evidence(ARGV[3], outcome .. ':' .. status .. ':' .. now)
  return helpers.current(state)
end
