{{/*
Shared logic of the chart. The role templates (router.yaml, workers.yaml)
stay thin: names, labels, the cluster config, and one pod template that
takes a role ("router", "prefill" or "decode") and, for workers, a site.
*/}}

{{/* Release-wide name, at most 40 characters so that pool names stay short. */}}
{{- define "kvrelay.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvrelay.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Labels that select one role's pods: (dict "root" $ "role" "decode" "site" "toronto"); site optional. */}}
{{- define "kvrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- with .site }}
kvrelay.io/site: {{ . }}
{{- end }}
{{- end -}}

{{- define "kvrelay.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Fixed places inside every pod. */}}
{{- define "kvrelay.paths" -}}
config: /etc/kvrelay/config/cluster.yaml
ca: /etc/kvrelay/ca/ca.crt
caKey: /etc/kvrelay/ca-signer/ca.key
tlsDir: /var/run/kvrelay/tls
cert: /var/run/kvrelay/tls/tls.pem
key: /var/run/kvrelay/tls/tls.key
kvSecret: /etc/kvrelay/kv/secret
model: /models/model
state: /var/lib/kvrelay
{{- end -}}

{{- define "kvrelay.ports" -}}
grpc: 50051
internal: 50052
http: 8000
{{- end -}}

{{- define "kvrelay.modelPath" -}}
{{- if eq .Values.model.source "image" -}}
{{ .Values.model.imagePath }}
{{- else -}}
{{ (include "kvrelay.paths" . | fromYaml).model }}
{{- end -}}
{{- end -}}

{{- define "kvrelay.kvSecretName" -}}
{{- .Values.kvSecret.existingSecret | default (printf "%s-kv" (include "kvrelay.fullname" .)) -}}
{{- end -}}

{{/*
The routers this release runs, as a JSON list of {name, site, id, svc}: the
one router (`router`, name "", identity kvrelay://<site>/router/0, Service
<release>-router), or one per entry of `routers` (kvrelay's routers:, each
kvrelay://<site>/router/<name>, Service <release>-router-<name>).
*/}}
{{- define "kvrelay.routerList" -}}
{{- $fullname := include "kvrelay.fullname" . -}}
{{- $out := list -}}
{{- if .Values.routers -}}
{{- range .Values.routers -}}
{{- $out = append $out (dict "name" .name "site" .site "id" .name "svc" (printf "%s-router-%s" $fullname .name) "entry" .) -}}
{{- end -}}
{{- else -}}
{{- $out = append $out (dict "name" "" "site" (.Values.router.site | default (index .Values.sites 0).name) "id" "0" "svc" (printf "%s-router" $fullname) "entry" .Values.router) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The Service names of one router (dict "root" $ "svc" "<release>-router"): its certificate is valid for each. */}}
{{- define "kvrelay.routerHosts" -}}
{{- $svc := .svc -}}
{{- $ns := .root.Release.Namespace -}}
{{- $hosts := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- concat $hosts .root.Values.tls.serverNames | toJson -}}
{{- end -}}

{{/* Every router's Service names (the config's tls.server_names). */}}
{{- define "kvrelay.allRouterHosts" -}}
{{- $all := list -}}
{{- range include "kvrelay.routerList" . | fromJsonArray -}}
{{- $all = concat $all (include "kvrelay.routerHosts" (dict "root" $ "svc" .svc) | fromJsonArray) -}}
{{- end -}}
{{- $all | uniq | toJson -}}
{{- end -}}

{{/* The internal address a worker at site .site registers with: its site's router, else the first. */}}
{{- define "kvrelay.workerRouter" -}}
{{- $ports := include "kvrelay.ports" .root | fromYaml -}}
{{- $routers := include "kvrelay.routerList" .root | fromJsonArray -}}
{{- $mine := index $routers 0 -}}
{{- $found := false -}}
{{- range $routers }}{{ if and (not $found) (eq .site $.site) }}{{ $mine = . }}{{ $found = true }}{{ end }}{{ end -}}
{{- printf "%s:%v" $mine.svc $ports.internal -}}
{{- end -}}

{{/*
The cluster config kvrelay parses (runtime/config.py): `config` from the
values, the sites, links and pools, and what Kubernetes decides (addresses,
ports, files, TLS, scaling). The schema refuses those fields under `config`.
*/}}
{{- define "kvrelay.clusterConfig" -}}
{{- $p := include "kvrelay.paths" . | fromYaml -}}
{{- $ports := include "kvrelay.ports" . | fromYaml -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $router := get $cfg "router" | default dict -}}
{{- $_ := set $router "host" "0.0.0.0" -}}
{{- $_ := set $router "port" $ports.grpc -}}
{{- $_ := set $router "internal_port" $ports.internal -}}
{{- $_ := set $router "http_port" $ports.http -}}
{{- $pools := get $router "pools" | default dict -}}
{{- $_ := set $pools "scaling" "external" -}}
{{- $_ := set $router "pools" $pools -}}
{{- $records := get $router "records" | default dict -}}
{{- $_ := set $records "jobs_db" (printf "%s/jobs.sqlite" $p.state) -}}
{{- $_ := set $records "audit_log" (printf "%s/audit.jsonl" $p.state) -}}
{{- $_ := set $records "usage_db" (printf "%s/usage.sqlite" $p.state) -}}
{{- if .Values.router.auditSigningKey.existingSecret -}}
{{- $_ := set $records "audit_signing_key" "/etc/kvrelay/audit-key/signing.key" -}}
{{- end -}}
{{- $_ := set $router "records" $records -}}
{{- if .Values.routers -}}
{{- $entries := list -}}
{{- range include "kvrelay.routerList" . | fromJsonArray -}}
{{- $entries = append $entries (dict "name" .name "site" .site "host" "0.0.0.0" "port" $ports.grpc "internal_port" $ports.internal "http_port" $ports.http "advertise" (printf "%s.%s.svc" .svc $.Release.Namespace)) -}}
{{- end -}}
{{- $_ := set $cfg "routers" $entries -}}
{{- $_ := set $cfg "etcd" (deepCopy .Values.etcd) -}}
{{- $_ := set $cfg "postgres" (deepCopy .Values.postgres) -}}
{{- else -}}
{{- with .Values.router.site }}{{ $_ := set $router "site" . }}{{ end -}}
{{- end -}}
{{- $_ := set $cfg "router" $router -}}
{{- $_ := set $cfg "model" (dict "path" (include "kvrelay.modelPath" .) "dtype" .Values.model.dtype) -}}
{{- $sites := list -}}
{{- range $s := .Values.sites -}}
{{- $site := dict "name" $s.name "jurisdiction" $s.jurisdiction -}}
{{- range $role := list "prefill" "decode" -}}
{{- $pool := get $s $role | default dict -}}
{{- $_ := set $site $role (omit $pool "resources" "nodeSelector" "tolerations") -}}{{/* every key but the chart's own */}}
{{- end -}}
{{- $sites = append $sites $site -}}
{{- end -}}
{{- $_ := set $cfg "sites" $sites -}}
{{- $_ := set $cfg "links" .Values.links -}}
{{- $_ := set $cfg "local_link" .Values.localLink -}}
{{- $workers := get $cfg "workers" | default dict -}}
{{- $_ := set $workers "host" "auto" -}}
{{- $_ := set $cfg "workers" $workers -}}
{{- $kv := get $cfg "kv" | default dict -}}
{{- $_ := set $kv "secret_file" $p.kvSecret -}}
{{- $_ := set $cfg "kv" $kv -}}
{{- $tls := get $cfg "tls" | default dict -}}
{{- $_ := set $tls "enabled" true -}}
{{- $_ := set $tls "ca" $p.ca -}}
{{- $_ := set $tls "cert" $p.cert -}}
{{- $_ := set $tls "key" $p.key -}}
{{- $_ := set $tls "cert_days" .Values.tls.certDays -}}
{{- $_ := set $tls "server_names" (include "kvrelay.allRouterHosts" . | fromJsonArray) -}}
{{- $_ := set $cfg "tls" $tls -}}
{{- $tel := get $cfg "telemetry" | default dict -}}
{{- $_ := set $tel "metrics_host" "0.0.0.0" -}}
{{- $_ := set $tel "metrics_exposed" true -}}
{{- $_ := set $tel "router_metrics_port" .Values.monitoring.port -}}
{{- $_ := set $tel "worker_metrics_port" .Values.monitoring.port -}}
{{- $_ := set $cfg "telemetry" $tel -}}
{{- $_ := set $cfg "health" (dict "host" "0.0.0.0" "router_port" .Values.healthPort "worker_port" .Values.healthPort) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Node selector of a pool: the site label, then the site's and the pool's own. (dict "root" $ "site" $site "pool" $pool) */}}
{{- define "kvrelay.nodeSelector" -}}
{{- $sel := dict .root.Values.siteLabel .site.name -}}
{{- $sel = merge $sel (.site.nodeSelector | default dict) (.pool.nodeSelector | default dict) -}}
{{- toYaml $sel -}}
{{- end -}}

{{/* Environment every kvrelay container gets. */}}
{{- define "kvrelay.env" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* Container security of every container. */}}
{{- define "kvrelay.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/*
The init container that gives a pod its certificate (tls.mode issuer):
`kvrelay pki issue` with the CA key, which only this container mounts.
(dict "root" $ "role" "decode" "site" "toronto" "name" "$(POD_NAME)" "hosts" (list ...))
*/}}
{{- define "kvrelay.certificateInit" -}}
{{- $p := include "kvrelay.paths" .root | fromYaml -}}
- name: certificate
  image: {{ include "kvrelay.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - kvrelay
    - pki
    - issue
    - --role={{ .role }}
    - --site={{ .site }}
    - --name={{ .name }}
    - --ca={{ $p.ca }}
    - --ca-key={{ $p.caKey }}
    - --days={{ .root.Values.tls.certDays }}
    - --out={{ $p.tlsDir }}
    - --stem=tls
    {{- range .hosts }}
    - --host={{ . }}
    {{- end }}
  env:
    {{- include "kvrelay.env" .root | nindent 4 }}
  securityContext:
    {{- include "kvrelay.containerSecurity" .root | nindent 4 }}
  volumeMounts:
    - {name: ca, mountPath: /etc/kvrelay/ca, readOnly: true}
    - {name: ca-signer, mountPath: /etc/kvrelay/ca-signer, readOnly: true}
    - {name: tls, mountPath: {{ $p.tlsDir }}}
{{- end -}}

{{/* The init container that copies the weights (model.source initContainer). */}}
{{- define "kvrelay.modelInit" -}}
{{- $p := include "kvrelay.paths" . | fromYaml -}}
- name: model
  image: {{ .Values.model.initContainer.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["cp", "-R", "{{ .Values.model.initContainer.path }}/.", "{{ $p.model }}/"]
  securityContext:
    {{- include "kvrelay.containerSecurity" . | nindent 4 }}
  volumeMounts:
    - {name: model, mountPath: {{ $p.model }}}
{{- end -}}

{{/* Volumes every kvrelay pod has: (dict "root" $ "role" "decode" "site" "toronto"); a router's also "svc" (its Service). */}}
{{- define "kvrelay.volumes" -}}
{{- $v := .root.Values -}}
- name: config
  configMap: {name: {{ include "kvrelay.fullname" .root }}-config}
- name: ca
  secret: {secretName: {{ $v.tls.ca.existingSecret }}, defaultMode: 0440, items: [{key: ca.crt, path: ca.crt}]}
{{- if eq $v.tls.mode "issuer" }}
- name: ca-signer
  secret: {secretName: {{ $v.tls.ca.existingSecret }}, defaultMode: 0440, items: [{key: ca.key, path: ca.key}]}
- name: tls
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- else if eq .role "router" }}
- name: tls
  secret:
    secretName: {{ .svc }}-tls
    defaultMode: 0440
    items: [{key: tls.crt, path: tls.pem}, {key: tls.key, path: tls.key}]
{{- else }}
- name: tls
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $v.tls.certManager.issuerRef.name }}
      csi.cert-manager.io/issuer-kind: {{ $v.tls.certManager.issuerRef.kind }}
      csi.cert-manager.io/issuer-group: {{ $v.tls.certManager.issuerRef.group }}
      csi.cert-manager.io/uri-sans: kvrelay://{{ .site }}/{{ .role }}/${POD_NAME}
      csi.cert-manager.io/dns-names: ${POD_NAME}.{{ .role }}.{{ .site }}.kvrelay,{{ .role }}.kvrelay
      csi.cert-manager.io/key-usages: server auth,client auth,digital signature
      csi.cert-manager.io/key-algorithm: ECDSA
      csi.cert-manager.io/duration: {{ mul $v.tls.certDays 24 }}h
      csi.cert-manager.io/certificate-file: tls.pem
      csi.cert-manager.io/privatekey-file: tls.key
      csi.cert-manager.io/fs-group: {{ $v.podSecurity.fsGroup | quote }}
{{- end }}
- name: kv-secret
  secret: {secretName: {{ include "kvrelay.kvSecretName" .root }}, defaultMode: 0440, items: [{key: secret, path: secret}]}
- name: tmp
  emptyDir: {sizeLimit: 1Gi}
{{- if eq $v.model.source "pvc" }}
- name: model
  persistentVolumeClaim: {claimName: {{ $v.model.pvc.claimName }}, readOnly: true}
{{- else if eq $v.model.source "initContainer" }}
- name: model
  emptyDir: {sizeLimit: {{ $v.model.initContainer.sizeLimit }}}
{{- end }}
{{- end -}}

{{/* Mounts of the main container. */}}
{{- define "kvrelay.volumeMounts" -}}
{{- $p := include "kvrelay.paths" . | fromYaml -}}
- {name: config, mountPath: /etc/kvrelay/config, readOnly: true}
- {name: ca, mountPath: /etc/kvrelay/ca, readOnly: true}
- {name: tls, mountPath: {{ $p.tlsDir }}, readOnly: true}
- {name: kv-secret, mountPath: /etc/kvrelay/kv, readOnly: true}
- {name: tmp, mountPath: /tmp}
{{- if eq .Values.model.source "pvc" }}
- {name: model, mountPath: {{ $p.model }}, subPath: {{ .Values.model.pvc.subPath | quote }}, readOnly: true}
{{- else if eq .Values.model.source "initContainer" }}
- {name: model, mountPath: {{ $p.model }}, readOnly: true}
{{- end }}
{{- end -}}

{{/* Probes on /livez and /readyz (runtime/health.py): root, the chart's context; startup, the seconds a
pod may take to start (a pool's start_timeout_s; none: probes.startupSeconds). */}}
{{- define "kvrelay.probes" -}}
{{- $period := .root.Values.probes.periodSeconds -}}
{{- $startup := int (ceil (.startup | default .root.Values.probes.startupSeconds)) -}}
startupProbe:
  httpGet: {path: /livez, port: health}
  periodSeconds: {{ $period }}
  failureThreshold: {{ div (add $startup $period -1) $period }}
livenessProbe:
  httpGet: {path: /livez, port: health}
  periodSeconds: {{ $period }}
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: health}
  periodSeconds: {{ $period }}
  timeoutSeconds: 5
  failureThreshold: 2
{{- end -}}

{{/* Pod-level settings every kvrelay pod shares. */}}
{{- define "kvrelay.podSpec" -}}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .Values.podSecurity.runAsUser }}
  runAsGroup: {{ .Values.podSecurity.fsGroup }}
  fsGroup: {{ .Values.podSecurity.fsGroup }}
  seccompProfile: {type: RuntimeDefault}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
