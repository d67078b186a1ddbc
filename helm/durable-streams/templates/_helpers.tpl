{{/* Names and labels, in the usual shape of well-kept charts. */}}
{{- define "ds.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ds.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ds.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "ds.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ds.selector" -}}
app.kubernetes.io/name: {{ include "ds.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ds.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ds.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given. Called with (dict "image" ... "tag" default). */}}
{{- define "ds.imageRef" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .tag .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "ds.image" -}}
{{- include "ds.imageRef" (dict "image" .Values.image "tag" .Chart.AppVersion) -}}
{{- end -}}

{{/* A value as an environment variable's text. Helm reads numbers in values files as floats,
which print as 2.68435456e+08; JSON prints them as written (268435456, 0.5). */}}
{{- define "ds.envText" -}}
{{- if kindIs "string" . -}}{{- . -}}{{- else -}}{{- toJson . -}}{{- end -}}
{{- end -}}

{{/* The Secret and key holding the Redis URL. */}}
{{- define "ds.redisSecret" -}}
{{- if .Values.externalRedis.existingSecret -}}
{{- .Values.externalRedis.existingSecret -}}
{{- else -}}
{{- printf "%s-redis-url" (include "ds.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The chart's own Redis (redis.enabled): its Service name and URL. */}}
{{- define "ds.redisName" -}}
{{- printf "%s-redis" (include "ds.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ds.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (include "ds.redisName" .) -}}
{{- else -}}
{{- .Values.externalRedis.url -}}
{{- end -}}
{{- end -}}

{{- define "ds.redisSecretKey" -}}
{{- if .Values.externalRedis.existingSecret -}}
{{- .Values.externalRedis.existingSecretKey -}}
{{- else -}}
redis-url
{{- end -}}
{{- end -}}

{{/* Where the archive lives, as the gateway and workers see it. */}}
{{- define "ds.archiveUrl" -}}
{{- if .Values.archive.url -}}{{- .Values.archive.url -}}{{- else if include "ds.archiveVolumeNeeded" . -}}/archive{{- end -}}
{{- end -}}

{{/* "true" when pods mount the shared archive volume (gateways read-only: reads fall through to it). */}}
{{- define "ds.archiveVolumeNeeded" -}}
{{- if and .Values.archive.enabled .Values.archive.sharedVolume.enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when the shared archive volume is not ReadWriteMany: every pod that mounts it must
share one node (a block volume attaches to one node: elsewhere, "Multi-Attach error"). */}}
{{- define "ds.archiveOnOneNode" -}}
{{- if and (include "ds.archiveVolumeNeeded" .) (not (has "ReadWriteMany" .Values.archive.sharedVolume.accessModes)) -}}true{{- end -}}
{{- end -}}

{{- define "ds.archiveClaim" -}}
{{- default (printf "%s-archive" (include "ds.fullname" .)) .Values.archive.sharedVolume.existingClaim -}}
{{- end -}}

{{/* The Redis URL (from its Secret); the rest comes from the settings ConfigMap. */}}
{{- define "ds.redisEnv" -}}
- name: DURABLE_STREAMS_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ds.redisSecret" . }}
      key: {{ include "ds.redisSecretKey" . }}
{{- end -}}

{{- define "ds.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "ds.fullname" . }}-settings
  {{- with .Values.archive.s3.existingSecret }}
  - secretRef:
      name: {{ . }}
  {{- end }}
{{- end -}}

{{/* Restart pods when their settings change. */}}
{{- define "ds.checksums" -}}
checksum/settings: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}

{{- define "ds.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ include "ds.envText" $value | quote }}
{{- end }}
{{- end -}}

{{/* A pod that mounts a shared archive volume that is not ReadWriteMany: on the node of the
gateways and archive workers, which have it (ds.archiveOnOneNode). */}}
{{- define "ds.archiveNodeAffinity" -}}
podAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchExpressions:
          - {key: app.kubernetes.io/name, operator: In, values: [{{ include "ds.name" . | quote }}]}
          - {key: app.kubernetes.io/instance, operator: In, values: [{{ .Release.Name | quote }}]}
          - {key: app.kubernetes.io/component, operator: In, values: [gateway, archive]}
{{- end -}}

{{/* Default scheduling (spreadPods) of one component, unless its own affinity /
topologySpreadConstraints are given: prefer other nodes, spread over zones; soft rules only.
Gateways and archive workers, which mount a shared archive volume that is not ReadWriteMany, all
go to its node instead. Called with (dict "root" $ "component" "gateway" "values" .Values.gateway). */}}
{{- define "ds.scheduling" -}}
{{- $selector := dict "app.kubernetes.io/name" (include "ds.name" .root) "app.kubernetes.io/instance" .root.Release.Name "app.kubernetes.io/component" .component -}}
{{- $pinned := and (include "ds.archiveOnOneNode" .root) (has .component (list "gateway" "archive")) -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .values.affinity }}
affinity:
  {{- toYaml .values.affinity | nindent 2 }}
{{- else if $pinned }}
# The archive volume is not ReadWriteMany: every pod that mounts it on the node that has it.
affinity:
  {{- include "ds.archiveNodeAffinity" .root | nindent 2 }}
{{- else if .root.Values.spreadPods }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- toYaml $selector | nindent 14 }}
{{- end }}
{{- if .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml .values.topologySpreadConstraints | nindent 2 }}
{{- else if and .root.Values.spreadPods (not $pinned) }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: topology.kubernetes.io/zone
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- toYaml $selector | nindent 8 }}
{{- end }}
{{- end -}}

{{/* Where /metrics, /healthz and /readyz answer: the admin port when there is one. */}}
{{- define "ds.opsPort" -}}
{{- if .Values.gateway.adminPort -}}admin{{- else -}}http{{- end -}}
{{- end -}}

{{/* The public base URL: gateway.publicUrl, else from a single-host Ingress. */}}
{{- define "ds.publicUrl" -}}
{{- if .Values.gateway.publicUrl -}}
{{- .Values.gateway.publicUrl | trimSuffix "/" -}}
{{- else if and .Values.ingress.enabled (eq (len .Values.ingress.hosts) 1) -}}
{{- $host := (first .Values.ingress.hosts).host -}}
{{- if $host -}}
{{- $tls := false -}}
{{- range .Values.ingress.tls -}}
{{- if or (not .hosts) (has $host .hosts) -}}{{- $tls = true -}}{{- end -}}
{{- end -}}
{{- printf "%s://%s" (ternary "https" "http" $tls) $host -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Proxies that append to X-Forwarded-For: "auto" is 1 behind the chart's Ingress. */}}
{{- define "ds.trustedProxyHops" -}}
{{- $hops := .Values.gateway.trustedProxyHops -}}
{{- if eq (toString $hops) "auto" -}}
{{- if .Values.ingress.enabled -}}1{{- else -}}0{{- end -}}
{{- else -}}
{{- $hops | int64 -}}
{{- end -}}
{{- end -}}

{{/* The chart's own Secret for inline auth material (tokens, signing key). */}}
{{- define "ds.authSecret" -}}
{{- printf "%s-auth" (include "ds.fullname" .) -}}
{{- end -}}

{{/* The Secret and key of the token file ("" when there is none). */}}
{{- define "ds.tokensSecret" -}}
{{- if .Values.auth.tokens.existingSecret -}}
{{- .Values.auth.tokens.existingSecret -}}
{{- else if .Values.auth.tokens.json -}}
{{- include "ds.authSecret" . -}}
{{- end -}}
{{- end -}}

{{- define "ds.tokensKey" -}}
{{- if .Values.auth.tokens.existingSecret -}}{{- .Values.auth.tokens.existingSecretKey -}}{{- else -}}tokens.json{{- end -}}
{{- end -}}

{{/* The inline token file as JSON text (a string as given, a YAML structure encoded). */}}
{{- define "ds.tokensJson" -}}
{{- $json := .Values.auth.tokens.json -}}
{{- if kindIs "string" $json -}}{{- $json -}}{{- else -}}{{- toJson $json -}}{{- end -}}
{{- end -}}

{{/* The Secret and key of the signed-URL key ("" when there is none). */}}
{{- define "ds.signingSecret" -}}
{{- if .Values.auth.signingKey.existingSecret -}}
{{- .Values.auth.signingKey.existingSecret -}}
{{- else if .Values.auth.signingKey.value -}}
{{- include "ds.authSecret" . -}}
{{- end -}}
{{- end -}}

{{- define "ds.signingKey" -}}
{{- if .Values.auth.signingKey.existingSecret -}}{{- .Values.auth.signingKey.existingSecretKey -}}{{- else -}}signing-key{{- end -}}
{{- end -}}

{{/* The Secret and key of the webhook signing key ("" when there is none: the delivery
workers then sign with a key kept in Redis). */}}
{{- define "ds.webhookKeySecret" -}}
{{- if .Values.deliver.signingKey.existingSecret -}}
{{- .Values.deliver.signingKey.existingSecret -}}
{{- else if .Values.deliver.signingKey.value -}}
{{- printf "%s-webhook-signing-key" (include "ds.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "ds.webhookKeyKey" -}}
{{- if .Values.deliver.signingKey.existingSecret -}}{{- .Values.deliver.signingKey.existingSecretKey -}}{{- else -}}signing-key.pem{{- end -}}
{{- end -}}

{{/* The ports delivery workers reach an external Redis on (networkPolicy.deliverEgress), one
per line: redisPorts, else the port of externalRedis.url (6379 when it names none, or when the URL
is in a Secret of yours). */}}
{{- define "ds.redisPorts" -}}
{{- $ports := .Values.networkPolicy.deliverEgress.redisPorts -}}
{{- if and (not $ports) (not .Values.redis.enabled) (not .Values.externalRedis.existingSecret) .Values.externalRedis.url -}}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" (urlParse .Values.externalRedis.url).host) -}}
{{- $ports = list ($port | default "6379") -}}
{{- end -}}
{{- range $ports | default (list 6379) }}
{{ include "ds.envText" . }}
{{- end -}}
{{- end -}}

{{/* "true" when access control is on: a credential source or anonymous grants (also through gateway.extraEnv). */}}
{{- define "ds.authEnabled" -}}
{{- $auth := .Values.auth -}}
{{- $on := or (include "ds.tokensSecret" .) $auth.jwt.jwksUrl $auth.jwt.keySecret (include "ds.signingSecret" .) (trim $auth.anonymous) -}}
{{- range $name := list "DURABLE_STREAMS_AUTH_TOKENS_FILE" "DURABLE_STREAMS_AUTH_JWT_KEY_FILE" "DURABLE_STREAMS_AUTH_JWKS_URL" "DURABLE_STREAMS_AUTH_SIGNING_KEY_FILE" "DURABLE_STREAMS_AUTH_ANONYMOUS" -}}
{{- if trim (toString (index $.Values.gateway.extraEnv $name | default "")) -}}{{- $on = true -}}{{- end -}}
{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}

{{/* Settings that cannot work together: refused at install rather than in a crash loop. */}}
{{- define "ds.validate" -}}
{{- if and .Values.gateway.adminPort (eq (int64 .Values.gateway.adminPort) (int64 .Values.gateway.port)) -}}
{{- fail "gateway.adminPort must differ from gateway.port (or be 0)" -}}
{{- end -}}
{{- if and .Values.auth.jwt.jwksUrl .Values.auth.jwt.keySecret -}}
{{- fail "set one of auth.jwt.jwksUrl and auth.jwt.keySecret, not both" -}}
{{- end -}}
{{- if and (or .Values.auth.jwt.jwksUrl .Values.auth.jwt.keySecret) (not .Values.auth.jwt.audience) -}}
{{- fail "JWT verification needs auth.jwt.audience (the 'aud' the gateways accept)" -}}
{{- end -}}
{{- if and .Values.cors.credentials (or (not .Values.cors.origins) (has "*" .Values.cors.origins)) -}}
{{- fail "cors.credentials needs explicit cors.origins (not \"*\")" -}}
{{- end -}}
{{- $external := or .Values.externalRedis.url .Values.externalRedis.existingSecret -}}
{{- if and .Values.redis.enabled $external -}}
{{- fail "redis.enabled installs the chart's own Redis: leave externalRedis.url and externalRedis.existingSecret empty (or set redis.enabled=false)" -}}
{{- end -}}
{{- if not (or .Values.redis.enabled $external) -}}
{{- fail "the gateways need Redis: set externalRedis.url (redis://host:6379/0), externalRedis.existingSecret, or redis.enabled=true for the chart's own" -}}
{{- end -}}
{{- if and .Values.tenants.enabled .Values.externalRedis.cluster -}}
{{- fail "tenants.enabled needs one Redis primary: a tenant's quotas and its streams are checked by one script (not externalRedis.cluster)" -}}
{{- end -}}
{{- if and .Values.redis.enabled (or .Values.externalRedis.cluster .Values.minReplicasAck) -}}
{{- fail "the chart's own Redis (redis.enabled) is one node without replicas: externalRedis.cluster and minReplicasAck need an external Redis" -}}
{{- end -}}
{{- if and .Values.externalRedis.cluster (hasPrefix "unix://" .Values.externalRedis.url) -}}
{{- fail "externalRedis.cluster needs a redis:// or rediss:// url: cluster nodes are found by address" -}}
{{- end -}}
{{- if and .Values.redis.enabled (not .Values.redis.maxmemory) -}}
{{- fail "redis.maxmemory is required with redis.enabled (about 75% of redis.resources.limits.memory)" -}}
{{- end -}}
{{- $gw := .Values.gateway -}}
{{- if and $gw.writePauseArchiveLagSeconds (not .Values.archive.enabled) -}}
{{- fail "gateway.writePauseArchiveLagSeconds needs archive.enabled: the lag is measured on the archive workers' hints" -}}
{{- end -}}
{{- if and $gw.podDisruptionBudget.enabled (not $gw.autoscaling.enabled) (le (int64 $gw.replicas) (int64 $gw.podDisruptionBudget.minAvailable)) -}}
{{- fail "gateway.podDisruptionBudget.minAvailable must be below gateway.replicas (else no node can ever be drained): raise replicas or disable the budget" -}}
{{- end -}}
{{- if and $gw.autoscaling.enabled (lt (int64 $gw.autoscaling.maxReplicas) (int64 $gw.autoscaling.minReplicas)) -}}
{{- fail "gateway.autoscaling.maxReplicas must be at least minReplicas" -}}
{{- end -}}
{{- if le (float64 $gw.terminationGracePeriodSeconds) (addf $gw.preStopSleepSeconds $gw.shutdownDelaySeconds $gw.shutdownSeconds) -}}
{{- fail "gateway.terminationGracePeriodSeconds must exceed preStopSleepSeconds + shutdownDelaySeconds + shutdownSeconds (else SIGKILL cuts the drain)" -}}
{{- end -}}
{{- if lt (addf $gw.preStopSleepSeconds $gw.shutdownDelaySeconds) (mulf $gw.readinessProbe.periodSeconds $gw.readinessProbe.failureThreshold) -}}
{{- fail "gateway.shutdownDelaySeconds (+ preStopSleepSeconds) must cover readinessProbe.periodSeconds x failureThreshold (else a load balancer that follows the probe sends to a gateway that stopped listening)" -}}
{{- end -}}
{{- if and .Values.ingress.enabled (le (float64 .Values.ingress.timeoutSeconds) (maxf $gw.longPollTimeoutSeconds $gw.sseCycleSeconds)) -}}
{{- fail "ingress.timeoutSeconds must exceed gateway.longPollTimeoutSeconds and gateway.sseCycleSeconds (else the proxy cuts live reads)" -}}
{{- end -}}
{{- if and .Values.archive.enabled (le (float64 .Values.archive.stallSeconds) (divf (mulf 2 .Values.archive.leaseSeconds) 3)) -}}
{{- fail "archive.stallSeconds must exceed two lease renewals (2/3 of archive.leaseSeconds): a worker busy with one long round would be restarted" -}}
{{- end -}}
{{- if .Values.archive.enabled -}}
{{- if and .Values.archive.url .Values.archive.sharedVolume.enabled -}}
{{- fail "archive: set archive.url (object storage) or archive.sharedVolume.enabled, not both" -}}
{{- end -}}
{{- if not (or .Values.archive.url .Values.archive.sharedVolume.enabled) -}}
{{- fail "archive.enabled needs a place every gateway and worker reaches: archive.url=s3://bucket/prefix (object storage), or archive.sharedVolume.enabled=true (a ReadWriteMany volume: NFS, CephFS, EFS...)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.spark.enabled (not .Values.spark.archiveUrl) (not .Values.archive.enabled) -}}
{{- fail "spark.enabled reads the archive: enable it (archive.enabled) or set spark.archiveUrl" -}}
{{- end -}}
{{- with .Values.backup -}}
{{- if .enabled -}}
{{- if not .to -}}
{{- fail "backup.enabled needs backup.to: where the backups go, s3://bucket/prefix (object storage), or a directory on backup.volume.existingClaim" -}}
{{- end -}}
{{- if or (not (contains "://" .to)) (hasPrefix "file://" .to) -}}
{{- $dir := trimPrefix "file://" .to | trimSuffix "/" -}}
{{- $mount := trimSuffix "/" .volume.mountPath -}}
{{- if not .volume.existingClaim -}}
{{- fail (printf "backup.to=%s is a local directory: it needs backup.volume.existingClaim (a PersistentVolumeClaim of yours, mounted at backup.volume.mountPath, %s), or back up to object storage (backup.to=s3://bucket/prefix)" .to .volume.mountPath) -}}
{{- end -}}
{{- if not (or (eq $dir $mount) (hasPrefix (printf "%s/" $mount) $dir)) -}}
{{- fail (printf "backup.to=%s must be backup.volume.mountPath (%s), where backup.volume.existingClaim is mounted, or a directory under it" .to .volume.mountPath) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
