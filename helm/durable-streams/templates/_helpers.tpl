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

{{- define "ds.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Secret and key holding the Redis URL. */}}
{{- define "ds.redisSecret" -}}
{{- if .Values.externalRedis.existingSecret -}}
{{- .Values.externalRedis.existingSecret -}}
{{- else -}}
{{- printf "%s-redis-url" (include "ds.fullname" .) -}}
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
{{- default "/archive" .Values.archive.url -}}
{{- end -}}

{{- define "ds.archiveVolumeNeeded" -}}
{{- if and .Values.archive.enabled (not .Values.archive.url) -}}true{{- end -}}
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
  value: {{ $value | quote }}
{{- end }}
{{- end -}}
