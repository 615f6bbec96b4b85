{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The tandem config the router reads: the user's, with the cluster's own settings. */}}
{{- define "tandem.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- $_ := set $cfg "ray_address" "auto" -}}
{{- $router := deepCopy (get $cfg "router" | default dict) -}}
{{- $_ := set $router "host" "0.0.0.0" -}}
{{- $_ := set $router "port" (int .Values.router.port) -}}
{{- $_ := set $router "http" (gt (int .Values.router.httpPort) 0) -}}
{{- if .Values.router.httpPort -}}
{{- $_ := set $router "http_port" (int .Values.router.httpPort) -}}
{{- end -}}
{{- $_ := set $cfg "router" $router -}}
{{- $metrics := deepCopy (get $cfg "metrics" | default dict) -}}
{{- $_ := set $metrics "host" "0.0.0.0" -}}
{{- $_ := set $metrics "port_base" (int .Values.metrics.portBase) -}}
{{- $_ := set $cfg "metrics" $metrics -}}
{{- if .Values.tritonCache.enabled -}}
{{- $engine := deepCopy (get $cfg "engine" | default dict) -}}
{{- $dir := .Values.tritonCache.mountPath -}}
{{- if and (get $engine "triton_cache_dir") (ne (get $engine "triton_cache_dir") $dir) -}}
{{- fail (printf "config.engine.triton_cache_dir=%v: with tritonCache.enabled the chart sets it to tritonCache.mountPath (%s); set that instead, or tritonCache.enabled=false" (get $engine "triton_cache_dir") $dir) -}}
{{- end -}}
{{- $_ := set $engine "triton_cache_dir" $dir -}}
{{- $_ := set $cfg "engine" $engine -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Fails the render when the config books more GPUs than the GPU workers have, or, in
colocated mode (one engine in the router's process on the head pod, which has no GPU), any GPU
or more than one replica. */}}
{{- define "tandem.checkGpus" -}}
{{- $cfg := .Values.config | default dict -}}
{{- $roles := list "prefill" "decode" -}}
{{- if include "tandem.engineOnHead" . -}}
{{- $dec := get $cfg "decode" | default dict -}}
{{- if or (eq (get $dec "device" | default "auto") "cuda") (gt (float64 (get $dec "num_gpus" | default 0)) 0.0) (gt (int (get $dec "replicas" | default 1)) 1) -}}
{{- fail "config.mode=colocated runs one engine in the router's process on the head pod, which has no GPU: set config.decode.device=cpu, num_gpus=0 and replicas=1, or serve disaggregated" -}}
{{- end -}}
{{- $roles = list -}}
{{- end -}}
{{- $need := 0.0 -}}
{{- range $role := $roles -}}
{{- $sec := get $cfg $role | default dict -}}
{{- $need = addf $need (mulf (get $sec "replicas" | default 1) (get $sec "num_gpus" | default 0)) -}}
{{- end -}}
{{- $have := mulf .Values.gpuWorkers.replicas .Values.gpuWorkers.gpusPerPod -}}
{{- if gt $need $have -}}
{{- fail (printf "config books %v GPUs (replicas x num_gpus of %s), the GPU workers have %v (gpuWorkers.replicas x gpusPerPod)" $need (join ", " $roles) $have) -}}
{{- end -}}
{{- end -}}

{{- define "tandem.volumes" -}}
- name: config
  configMap:
    name: {{ include "tandem.fullname" . }}-config
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- if .Values.models.persistentVolumeClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.persistentVolumeClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.mounts" -}}
- name: config
  mountPath: /etc/tandem
  readOnly: true
- name: shm
  mountPath: /dev/shm
{{- if .Values.models.persistentVolumeClaim }}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* "true" where the head pod runs the engine (colocated mode), not only the router. */}}
{{- define "tandem.engineOnHead" -}}
{{- if eq (get (.Values.config | default dict) "mode" | default "disaggregated") "colocated" -}}true{{- end -}}
{{- end -}}

{{/* Triton's kernel cache (tritonCache) for a pod that runs engines: its volume ("volume") or
its mount ("mount"); called with (list $ "volume"). */}}
{{- define "tandem.tritonCache" -}}
{{- $root := index . 0 -}}
{{- $c := $root.Values.tritonCache -}}
{{- if eq (index . 1) "volume" -}}
- name: triton-cache
{{- if $c.persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ $c.persistentVolumeClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $c.sizeLimit }}
{{- end }}
{{- else -}}
- name: triton-cache
  mountPath: {{ $c.mountPath }}
{{- end -}}
{{- end -}}

{{- define "tandem.env" -}}
- name: UCX_WARN_UNUSED_ENV_VARS
  value: "n"
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Whether the config serves metrics (config.metrics.enabled, true when unset). */}}
{{- define "tandem.metricsOn" -}}
{{- $m := get (.Values.config | default dict) "metrics" | default dict -}}
{{- if or (not (hasKey $m "enabled")) $m.enabled -}}true{{- end -}}
{{- end -}}

{{/* The node actors' metrics ports, as cluster/config.py numbers them (components() order:
prefill-0.., then decode-0..; portBase + k), a YAML list of {name, port}. Colocated mode has
no node actors: its engine runs in the router. */}}
{{- define "tandem.nodeMetricsPorts" -}}
{{- $cfg := .Values.config | default dict -}}
{{- $ports := list -}}
{{- if and (include "tandem.metricsOn" .) (ne (get $cfg "mode" | default "disaggregated") "colocated") -}}
{{- $k := 1 -}}
{{- range $role := list "prefill" "decode" -}}
{{- $n := int (get (get $cfg $role | default dict) "replicas" | default 1) -}}
{{- range $i := until $n -}}
{{- $port := add $.Values.metrics.portBase $k -}}
{{- if gt $port 65535 -}}
{{- fail (printf "metrics.portBase=%v leaves no room for the node actors' metrics ports (%s-%d would get %v; ports end at 65535)" $.Values.metrics.portBase $role $i $port) -}}
{{- end -}}
{{- $ports = append $ports (dict "name" (printf "%s-%d" $role $i) "port" $port) -}}
{{- $k = add $k 1 -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $ports -}}
{{- end -}}

{{/* The router's probes: gRPC health where it answers without TLS or a token, else TCP. */}}
{{- define "tandem.probes" -}}
{{- $sec := get (.Values.config | default dict) "security" | default dict -}}
{{- $grpc := and (not (get $sec "tls_cert")) (or (not (hasKey $sec "health_open")) $sec.health_open) -}}
{{- $check := ternary (dict "grpc" (dict "port" (int .Values.router.port))) (dict "tcpSocket" (dict "port" "grpc")) $grpc -}}
{{- $p := .Values.router.probes -}}
startupProbe:
  {{- toYaml (merge (dict "timeoutSeconds" 5) $p.startup $check) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (dict "timeoutSeconds" 5) $p.readiness $check) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (dict "timeoutSeconds" 5) $p.liveness $check) | nindent 2 }}
{{- end -}}
