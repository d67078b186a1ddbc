package main

// The output of `helm template`: every rendered file split into YAML documents, each
// printed as "---\n# Source: <chart>/templates/<file>\n<document>\n". Ordinary manifests
// come first, in Helm's documented install order of kinds; hooks (documents annotated
// helm.sh/hook, e.g. the `helm test` pods) follow, in the same order.

import (
	"fmt"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

// installOrder: the kinds Helm creates first. Kinds not listed (custom resources) come
// after them, alphabetically; within a kind, file name order, then order within the file.
var installOrder = strings.Fields(`Namespace NetworkPolicy ResourceQuota LimitRange
	PodSecurityPolicy PodDisruptionBudget ServiceAccount Secret SecretList ConfigMap
	StorageClass PersistentVolume PersistentVolumeClaim CustomResourceDefinition
	ClusterRole ClusterRoleList ClusterRoleBinding ClusterRoleBindingList Role RoleList
	RoleBinding RoleBindingList Service DaemonSet Pod ReplicationController ReplicaSet
	Deployment HorizontalPodAutoscaler StatefulSet Job CronJob IngressClass Ingress
	APIService MutatingWebhookConfiguration ValidatingWebhookConfiguration`)

type manifest struct {
	source, text, kind string
	hook, test         bool
}

// head is the part of a document the ordering needs. Decoding it also checks that the
// whole document is valid YAML, and that annotations are strings, as Helm does.
type head struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
}

func manifestsOutput(rendered map[string]string, skipTests bool) (string, error) {
	names := make([]string, 0, len(rendered))
	for name := range rendered {
		names = append(names, name)
	}
	sort.Strings(names)
	var all []manifest
	for _, name := range names {
		for _, doc := range splitDocuments(rendered[name]) {
			var h head
			if err := yaml.Unmarshal([]byte(doc), &h); err != nil {
				return "", fmt.Errorf("YAML parse error on %s: %w", name, err)
			}
			m := manifest{source: name, text: doc, kind: h.Kind}
			if hook, ok := h.Metadata.Annotations["helm.sh/hook"]; ok {
				m.hook = true
				for _, event := range strings.Split(hook, ",") {
					event = strings.TrimSpace(event)
					m.test = m.test || event == "test" || event == "test-success"
				}
			}
			all = append(all, m)
		}
	}
	rank := map[string]int{}
	for i, kind := range installOrder {
		rank[kind] = i
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if a.hook != b.hook {
			return b.hook
		}
		ra, knownA := rank[a.kind]
		rb, knownB := rank[b.kind]
		switch {
		case knownA && knownB:
			return ra < rb
		case knownA != knownB:
			return knownA
		default:
			return a.kind < b.kind
		}
	})
	var out strings.Builder
	for _, m := range all {
		if m.test && skipTests {
			continue
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", m.source, m.text)
	}
	return out.String(), nil
}

// splitDocuments cuts at lines beginning with `---` (a YAML document start; text after it
// on that line stays with the document) and drops documents that are only whitespace.
// A document holding only comments is kept, as helm prints it.
func splitDocuments(text string) []string {
	var docs []string
	var cur strings.Builder
	flush := func() {
		if doc := strings.TrimSpace(cur.String()); doc != "" {
			docs = append(docs, doc)
		}
		cur.Reset()
	}
	for _, line := range strings.SplitAfter(text, "\n") {
		if rest := strings.TrimPrefix(line, "---"); rest != line && (rest == "" || rest[0] == ' ' || rest[0] == '\t' || rest[0] == '\n' || rest[0] == '\r') {
			flush()
			cur.WriteString(rest)
			continue
		}
		cur.WriteString(line)
	}
	flush()
	return docs
}
