-- Holds a boundary back for ARGV[1] microseconds from the Redis clock's
-- now; a longer cooldown already set stays. KEYS[1]: the cooldown.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period = tonumber(ARGV[1])
local until_at = now + period
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if until_at > current then
  redis.call('SET', KEYS[1], string.format('%.0f', until_at),
    'PX', math.floor(period / 1000) + 1)
end
return 1
