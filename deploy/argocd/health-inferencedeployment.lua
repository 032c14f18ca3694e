-- Argo CD health check for splitserve.io/InferenceDeployment.
-- Progressing: the operator has not yet observed the latest spec (metadata.generation differs from
--   status.observedGeneration), or has not reported a Ready condition yet (or reports Ready=Unknown).
-- Healthy:     Ready=True.
-- Degraded:    Ready=False; the message lists every failing part as "Type: Reason: message"
--   (PrefillReady/DecodeReady/RouterReady with status False, and Degraded=True).
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
