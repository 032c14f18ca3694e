-- Argo CD health check for splitserve.io/InferenceDeployment.
-- Progressing: the operator has not yet observed the latest spec (metadata.generation differs from
--   status.observedGeneration), or has not reported a Ready condition yet (or reports Ready=Unknown).
-- Healthy:     Ready=True.
-- Degraded:    Ready=False; the message lists every failing part as "Type: Reason: message"
--   (PrefillReady/DecodeReady/RouterReady with status False, and Degraded=True).
-- KV-generation rollouts (status.rollout present) come first, since the old pools keep Ready=True:
--   Degraded while paused (Progressing=False with reason RolloutPaused, or status.rollout.paused):
--     the message is status.rollout.message, the analysis' numbers;
--   Progressing while Progressing=True with reason RollingOut (unless Ready=False: a real failure
--     is reported as above); the message carries status.rollout.summary.
--   A roll of pods within one generation (no status.rollout) is judged by Ready alone, as before.
local hs = {}

local function describe(condition)
  local text = condition.type
  if condition.reason ~= nil and condition.reason ~= "" then
    text = text .. ": " .. condition.reason
  end
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

if obj.status == nil or obj.status.conditions == nil or #obj.status.conditions == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the splitserve operator to report status"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  if observed ~= nil then
    hs.message = hs.message .. " (observed " .. tostring(observed) .. ")"
  end
  return hs
end

local byType = {}
for _, condition in ipairs(obj.status.conditions) do
  if condition.type ~= nil then
    byType[condition.type] = condition
  end
end

local ready = byType["Ready"]
local progressing = byType["Progressing"]
local rollout = obj.status.rollout

local function pausedRollout()
  if progressing ~= nil and progressing.status == "False" and progressing.reason == "RolloutPaused" then
    return true
  end
  return rollout ~= nil and rollout.paused == true
end

if pausedRollout() then
  hs.status = "Degraded"
  local message = nil
  if rollout ~= nil and rollout.message ~= nil and rollout.message ~= "" then
    message = rollout.message
  elseif progressing ~= nil and progressing.message ~= nil and progressing.message ~= "" then
    message = progressing.message
  end
  hs.message = "Rollout paused"
  if rollout ~= nil and rollout.generation ~= nil and rollout.generation ~= "" then
    hs.message = hs.message .. " (generation " .. rollout.generation .. ")"
  end
  if message ~= nil then
    hs.message = hs.message .. ": " .. message
  end
  return hs
end

local readyFailed = ready ~= nil and ready.status == "False"
if rollout ~= nil and not readyFailed and progressing ~= nil and progressing.status == "True"
    and progressing.reason == "RollingOut" then
  hs.status = "Progressing"
  hs.message = "Rolling out"
  if rollout.summary ~= nil and rollout.summary ~= "" then
    hs.message = hs.message .. " " .. rollout.summary
  elseif rollout.generation ~= nil and rollout.generation ~= "" then
    hs.message = hs.message .. " generation " .. rollout.generation
  end
  if progressing.message ~= nil and progressing.message ~= "" then
    hs.message = hs.message .. ": " .. progressing.message
  end
  return hs
end

if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
  return hs
end

if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end

if ready.status == "False" then
  local failing = {}
  for _, partType in ipairs({"PrefillReady", "DecodeReady", "RouterReady"}) do
    local part = byType[partType]
    if part ~= nil and part.status == "False" then
      table.insert(failing, describe(part))
    end
  end
  local degraded = byType["Degraded"]
  if degraded ~= nil and degraded.status == "True" then
    table.insert(failing, describe(degraded))
  end
  if #failing == 0 then
    table.insert(failing, describe(ready))
  end
  hs.status = "Degraded"
  hs.message = table.concat(failing, "; ")
  return hs
end

hs.status = "Progressing"
hs.message = describe(ready)
return hs
