-- ARGV: generation, owner token, attempt id, '<status>:<stored>' (stored
--       '1' or '0'), encoded headers, body, the end time (the caller's
--       clock, Unix ms)
-- Answers the integer 1 on its hot path (recorded), else a table led by
-- its kind (fence.lua).
--@holder
if state == 'processing' and gen == ARGV[1] and owner == ARGV[2] then
  -- The hot path: the caller holds the lease (the record is live, see
  -- head.lua). Retention counts from the reservation: the expiry stays
  -- as it is.
  local headers, body = ARGV[5], ARGV[6]
  -- The attempt's end by the caller's clock: the hot path reads no clock
  -- (TIME and its conversion cost a fifth of this script). Leases,
  -- retention and expiry stay on Redis' clock.
  local ended = ARGV[7]
  local small = #headers <= 64 and #body <= 64
  if not small then
    -- Too long for the compact encoding: the response gets a key of its own.
    local expires
    if n then
      local started, retention_ms = string.match(n, '^(%d+):%d+:(%d+)$')
      expires = string.format('%d', tonumber(started) + tonumber(retention_ms))
    else
      expires = redis.call('HGET', record, @expires@)
    end
    redis.call('SET', record .. ':r', headers .. body, 'PXAT', expires)
  end
  if n then
    local done = ARGV[4] .. ':' .. ended
    if small then
      redis.call('HSET', record, @state@, 'completed', @d@, done, @headers@, headers, @body@, body)
    else
      redis.call('HSET', record, @state@, 'completed', @d@, done,
        @split@, string.format('%d', #headers))
    end
  else
    local status, stored = string.match(ARGV[4], '^(%d+):(%d)$')
    if small then
      redis.call('HSET', record, @state@, 'completed', @status@, status, @stored@, stored,
        @headers@, headers, @body@, body, @cur_end@, ended, @cur_outcome@, 'completed')
    else
      redis.call('HSET', record, @state@, 'completed', @status@, status, @stored@, stored,
        @split@, string.format('%d', #headers), @cur_end@, ended, @cur_outcome@, 'completed')
    end
  end
  if watched and NOTIFY then
    redis.call('PUBLISH', record .. ':c', '1')
  end
  -- Recorded: an integer, not a table (see reserve.lua).
  return 1
end
--@clock
--@common
--@fence
return fenced('completed', string.match(ARGV[4], '^%d+'), state, n)
