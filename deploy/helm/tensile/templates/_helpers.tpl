{{/*
The labels every object of the chart carries besides those of deploy/ (tests/helm.rs
ignores exactly these keys when it compares the chart with `kubectl kustomize deploy/all`).
*/}}
{{- define "tensile.labels" -}}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: tensile
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* `labels:` for an object whose own labels are `app: <name>`. */}}
{{- define "tensile.appLabels" -}}
labels:
  app: {{ .app }}
  {{- include "tensile.labels" .root | nindent 2 }}
{{- end }}

{{/* The image of binary .binary: <repository>/<binary>:<tag, else appVersion>. */}}
{{- define "tensile.image" -}}
image: {{ printf "%s/%s:%s" .root.Values.image.repository .binary (.root.Values.image.tag | default .root.Chart.AppVersion) }}
{{- with .root.Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/* The pod-level fields every component shares, from its values (.values). */}}
{{- define "tensile.podExtras" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
- name: {{ . }}
{{- end }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The API server's address for a container that talks to it, where apiServer is set (pods
that cannot reach the `kubernetes` Service): the variables in-cluster configuration reads,
which the kubelet otherwise sets from that Service. Entries of an `env:` list.
*/}}
{{- define "tensile.apiServerEnv" -}}
{{- with .Values.apiServer }}
{{- if or .host .port }}
{{- if not (and .host .port) }}
{{- fail "apiServer: set both host and port, or neither" }}
{{- end }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .port | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The security context of every tensile container (deploy/README.md). */}}
{{- define "tensile.securityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  capabilities: {drop: [ALL]}
  seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* Anti-affinity that spreads the replicas of app .app over nodes. */}}
{{- define "tensile.spread" -}}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels: {app: {{ . }}}
{{- end }}

{{/*
The objects of a kustomize file under files/ (links into deploy/: one source of truth), as a
JSON list. Comment-only documents are skipped; a document that does not parse fails.
*/}}
{{- define "tensile.fileObjects" -}}
{{- $objects := list }}
{{- range $doc := regexSplit "(?m)^---[ \t]*$" (.root.Files.Get .file) -1 }}
{{- $o := fromYaml $doc }}
{{- if hasKey $o "Error" }}
{{- fail (printf "%s: %s" $.file $o.Error) }}
{{- end }}
{{- if hasKey $o "kind" }}
{{- $objects = append $objects $o }}
{{- end }}
{{- end }}
{{- if not $objects }}
{{- fail (printf "%s: no object (is files/ a link into deploy/?)" .file) }}
{{- end }}
{{- toJson $objects }}
{{- end }}

{{/*
One object read from deploy/, as `kubectl kustomize` with `namespace:` would render it in
the release namespace: metadata.namespace on namespaced kinds, and the namespace of
ServiceAccount subjects; plus the chart's labels.
*/}}
{{- define "tensile.emit" -}}
{{- $o := .object }}
{{- $ns := .root.Release.Namespace }}
{{- if not (has $o.kind (list "Namespace" "ClusterRole" "ClusterRoleBinding" "MutatingWebhookConfiguration" "ValidatingWebhookConfiguration")) }}
{{- $_ := set $o.metadata "namespace" $ns }}
{{- end }}
{{- $labels := merge (dict) (include "tensile.labels" .root | fromYaml) (default (dict) $o.metadata.labels) }}
{{- $_ := set $o.metadata "labels" $labels }}
{{- range $s := (default (list) $o.subjects) }}
{{- if eq $s.kind "ServiceAccount" }}
{{- $_ := set $s "namespace" $ns }}
{{- end }}
{{- end }}
---
{{ toYaml $o }}
{{- end }}

{{/* Every object of a file under files/, emitted. */}}
{{- define "tensile.fromFile" -}}
{{- range $o := include "tensile.fileObjects" . | fromJsonArray }}
{{- include "tensile.emit" (dict "root" $.root "object" $o) }}
{{- end }}
{{- end }}
