-- A boundary's retry budget over a window, on the Redis clock. KEYS[1]: a
-- hash of the window's start, requests and retries. ARGV: window (ms),
-- retries always allowed, share of requests allowed as retries, and 1 to
-- ask for a retry (0 counts a first attempt). Answers 1 (allowed) or 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '0')
if now - start >= window then
  redis.call('HSET', KEYS[1], 'start', string.format('%.0f', now), 'requests', 0, 'retries', 0)
  redis.call('PEXPIRE', KEYS[1], window * 2)
end
if ARGV[4] == '0' then
  redis.call('HINCRBY', KEYS[1], 'requests', 1)
  return 1
end
local requests = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
local retries = tonumber(redis.call('HGET', KEYS[1], 'retries') or '0')
local allowed = tonumber(ARGV[2]) + math.floor(requests * tonumber(ARGV[3]))
if retries < allowed then
  redis.call('HINCRBY', KEYS[1], 'retries', 1)
  return 1
end
return 0
