-- ARGV: generation, owner token, attempt id, the end time (the caller's
--       clock, Unix ms; see complete.lua)
-- Answers the integer 1 on its hot path (released), else a table led by
-- its kind (fence.lua).
--@holder
if state == 'processing' and gen == ARGV[1] and owner == ARGV[2] and gen == '1' then
  -- The hot path: the caller holds the lease of a first attempt (the
  -- record is live, see head.lua).
  local ended = ARGV[4]
  if n then
    redis.call('HSET', record, @state@, 'released', @d@, '::' .. ended)
  else
    redis.call('HSET', record, @state@, 'released', @cur_end@, ended, @cur_outcome@, 'released')
  end
  if watched and NOTIFY then
    redis.call('PUBLISH', record .. ':c', '1')
  end
  -- Released: an integer, not a table (see reserve.lua).
  return 1
end
--@clock
--@common
if state == 'processing' and gen == ARGV[1] and owner == ARGV[2] then
  -- A later attempt's release (its record is expanded: a second attempt
  -- expands a packed one), for the same request only when an attempt of
  -- unknown outcome is in the history.
  rare().release_current(ARGV[4])
  if watched then
    rare().notify()
  end
  return 1
end
--@fence
return fenced('released', '', state, n)
