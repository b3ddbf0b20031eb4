-- The fence of complete and release (after the helpers, for their cold
-- paths). Their hot path, inline before the helpers, handles a caller
-- (ARGV: generation, owner token, attempt id) that holds a live lease;
-- `fenced(outcome, status, state, n)`, given the state and the packed
-- fields (n, nil for an expanded record) that holder.lua read, expands a
-- packed record and answers everything else: vacant, the retry of this
-- very outcome whose reply was lost, or the record's state now, the
-- attempt's outcome kept as late evidence ('completed:201:<ms>',
-- 'released::<ms>').
local function fenced(outcome, status, state, n)
  if n then
    expand(n)
  end
  local gen, expires, cur_id, cur_outcome = unpack(redis.call('HMGET', record, @gen@, @expires@,
    @cur_id@, @cur_outcome@))
  if not live(state, expires) then
    return {'vacant'}
  end
  -- A release that kept the record processing (release.lua) ended its
  -- attempt all the same.
  local ended = state == outcome or (outcome == 'released' and state == 'processing')
  if ended and gen == ARGV[1] and cur_id == ARGV[3] and cur_outcome == outcome then
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
