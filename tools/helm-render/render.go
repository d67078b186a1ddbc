package main

// Rendering: Go's text/template with sprig's functions and the ones Helm adds, over the
// built-in objects Helm documents (.Values, .Release, .Chart, .Capabilities, .Template,
// .Files), with Helm's habits: missing keys render empty, partials (`_*`) render nothing,
// `fail`/`required` are reported as "execution error at (file:line:col): message".

import (
	"bytes"
	"crypto/sha512"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/BurntSushi/toml"
	"github.com/Masterminds/semver/v3"
	"github.com/Masterminds/sprig/v3"
	"github.com/gobwas/glob"
	"sigs.k8s.io/yaml"
)

// ---- .Capabilities

// defaultKubeVersion is the cluster version when --kube-version is not given.
const defaultKubeVersion = "v1.35.0"

// defaultAPIVersions: the group/versions a current cluster (Kubernetes 1.33-1.37) serves by
// default, GA only. `helm template` answers from the (larger) list built into its client
// library; see README.md.
var defaultAPIVersions = strings.Fields(`v1 admissionregistration.k8s.io/v1 apiextensions.k8s.io/v1
	apiregistration.k8s.io/v1 apps/v1 authentication.k8s.io/v1 authorization.k8s.io/v1
	autoscaling/v1 autoscaling/v2 batch/v1 certificates.k8s.io/v1 coordination.k8s.io/v1
	discovery.k8s.io/v1 events.k8s.io/v1 flowcontrol.apiserver.k8s.io/v1 networking.k8s.io/v1
	node.k8s.io/v1 policy/v1 rbac.authorization.k8s.io/v1 resource.k8s.io/v1 scheduling.k8s.io/v1
	storage.k8s.io/v1`)

var helmVersion = buildInfo{Version: "v3.19.0", GitCommit: "helm-render", GitTreeState: "clean", GoVersion: runtime.Version()}

type capabilities struct {
	KubeVersion kubeVersion
	APIVersions versionSet
	HelmVersion buildInfo
}

// kubeVersion prints as its Version ("v1.35.0"), like Helm's.
type kubeVersion struct{ Version, Major, Minor string }

func (k kubeVersion) String() string     { return k.Version }
func (k kubeVersion) GitVersion() string { return k.Version }

type buildInfo struct{ Version, GitCommit, GitTreeState, GoVersion string }

// versionSet answers .Capabilities.APIVersions.Has "apps/v1" (or "apps/v1/Deployment", true
// only when given that way with -a).
type versionSet []string

func (s versionSet) Has(v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func apiVersionSet(extra []string) versionSet {
	set := append(versionSet{}, defaultAPIVersions...)
	for _, arg := range extra {
		for _, v := range strings.Split(arg, ",") {
			if v = strings.TrimSpace(v); v != "" {
				set = append(set, v)
			}
		}
	}
	return set
}

// parseKubeVersion accepts 1.35, 1.35.0, v1.35.0, v1.30.2-gke.1.
func parseKubeVersion(s string) (*kubeVersion, error) {
	v, err := semver.NewVersion(s)
	if err != nil {
		return nil, fmt.Errorf("invalid kube version %q: %w", s, err)
	}
	return &kubeVersion{
		Version: "v" + strings.TrimPrefix(s, "v"),
		Major:   strconv.FormatUint(v.Major(), 10),
		Minor:   strconv.FormatUint(v.Minor(), 10),
	}, nil
}

// ---- .Files: the chart's other files (not Chart.yaml, values.yaml, templates/, charts/)

type files map[string][]byte

func (f files) Get(name string) string      { return string(f[name]) }
func (f files) GetBytes(name string) []byte { return f[name] }

// Lines splits a file into lines; a final newline does not add an empty line.
func (f files) Lines(name string) []string {
	text := strings.TrimSuffix(string(f[name]), "\n")
	if text == "" {
		return []string{}
	}
	return strings.Split(text, "\n")
}

// Glob selects files by shell pattern; `*` stops at `/`, `**` crosses it.
func (f files) Glob(pattern string) files {
	out := files{}
	g, err := glob.Compile(pattern, '/')
	if err != nil {
		return out
	}
	for name, data := range f {
		if g.Match(name) {
			out[name] = data
		}
	}
	return out
}

// AsConfig is a ConfigMap's `data:` body: base name -> contents, as YAML.
func (f files) AsConfig() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	return toYAML(m)
}

// AsSecrets is a Secret's `data:` body: base name -> base64 contents, as YAML.
func (f files) AsSecrets() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = base64.StdEncoding.EncodeToString(data)
	}
	return toYAML(m)
}

// ---- the engine

// maxIncludeDepth stops include/tpl recursion (a template including itself) with an error
// instead of exhausting the stack.
const maxIncludeDepth = 1000

type engine struct {
	root  *template.Template
	depth int
}

type renderedChart struct {
	files map[string]string // template name -> rendered text, manifests only
	notes string            // templates/NOTES.txt
}

func renderChart(c *chart, values valueMap, release valueMap, caps capabilities) (*renderedChart, error) {
	e := &engine{}
	// missingkey=zero: a missing map key gives nil (printed "<no value>", blanked below)
	// rather than an error, as in Helm.
	e.root = template.New(c.meta.Name).Option("missingkey=zero")
	e.root.Funcs(e.funcs(e.root))
	// Helm's order (observed): deepest paths first, then names in reverse. A name defined
	// twice keeps its last definition, so the shallowest, alphabetically first file wins;
	// rendering follows the same order, which decides the failure reported first.
	order := append([]templateFile{}, c.templates...)
	sort.SliceStable(order, func(i, j int) bool {
		di, dj := strings.Count(order[i].name, "/"), strings.Count(order[j].name, "/")
		if di != dj {
			return di > dj
		}
		return order[i].name > order[j].name
	})
	for _, t := range order {
		if _, err := e.root.New(t.name).Parse(t.text); err != nil {
			return nil, parseError(err)
		}
	}
	basePath := path.Join(c.meta.Name, "templates")
	out := &renderedChart{files: map[string]string{}}
	for _, t := range order {
		base := path.Base(t.name)
		if strings.HasPrefix(base, "_") { // partials: only their defines matter
			continue
		}
		data := valueMap{
			"Values": values, "Release": release, "Chart": &c.meta, "Capabilities": &caps,
			"Files": c.files, "Subcharts": valueMap{},
			"Template": valueMap{"Name": t.name, "BasePath": basePath},
		}
		text, err := e.execute(e.root.Lookup(t.name), data)
		if err != nil {
			return nil, execError(err)
		}
		switch {
		case t.name == path.Join(basePath, "NOTES.txt"):
			out.notes = text
		case base == "NOTES.txt": // another NOTES.txt: rendered, never a manifest
		default:
			out.files[t.name] = text
		}
	}
	return out, nil
}

// execute runs one template; "<no value>" (a missing key printed) becomes "", as in Helm.
func (e *engine) execute(t *template.Template, data interface{}) (string, error) {
	if t == nil || t.Tree == nil {
		return "", nil
	}
	var b strings.Builder
	if err := t.Execute(&b, data); err != nil {
		return "", err
	}
	return strings.ReplaceAll(b.String(), "<no value>", ""), nil
}

// funcs: sprig's text functions without env/expandenv (templates must not read the
// environment), plus Helm's own. include and tpl are bound to the template set they run in.
func (e *engine) funcs(set *template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	helm := template.FuncMap{
		"include":       func(name string, data interface{}) (string, error) { return e.include(set, name, data) },
		"tpl":           func(text string, data interface{}) (string, error) { return e.tpl(set, text, data) },
		"required":      required,
		"fail":          fail,
		"toYaml":        toYAML,
		"fromYaml":      fromYAML,
		"fromYamlArray": fromYAMLArray,
		"toJson":        toJSON,
		"fromJson":      fromJSON,
		"fromJsonArray": fromJSONArray,
		"toToml":        toTOML,
		"fromToml":      fromTOML,
		// helm template talks to no cluster: lookup finds nothing.
		"lookup": func(apiVersion, kind, namespace, name string) (valueMap, error) { return valueMap{}, nil },
	}
	for name, fn := range helm {
		f[name] = fn
	}
	if _, ok := f["sha512sum"]; !ok { // sprig 3.3 has it; Debian's 3.2.3 does not
		f["sha512sum"] = func(s string) string {
			sum := sha512.Sum512([]byte(s))
			return hex.EncodeToString(sum[:])
		}
	}
	return f
}

// include renders a named template (a define, or a whole file by its name) to a string.
// Unlike `template`, its output can be piped; "<no value>" is left for the caller's output.
func (e *engine) include(set *template.Template, name string, data interface{}) (string, error) {
	if e.depth >= maxIncludeDepth {
		return "", fmt.Errorf("include %q: nested more than %d deep (does a template include itself?)", name, maxIncludeDepth)
	}
	e.depth++
	defer func() { e.depth-- }()
	var b strings.Builder
	err := set.ExecuteTemplate(&b, name, data)
	return b.String(), err
}

// tpl renders a string as a template, with the chart's defines available.
func (e *engine) tpl(set *template.Template, text string, data interface{}) (string, error) {
	if e.depth >= maxIncludeDepth {
		return "", fmt.Errorf("tpl: nested more than %d deep", maxIncludeDepth)
	}
	e.depth++
	defer func() { e.depth-- }()
	// A clone, so that defines in the text stay local to this call; its include sees them.
	clone, err := set.Clone()
	if err != nil {
		return "", err
	}
	clone.Option("missingkey=zero") // not carried over by Clone
	clone.Funcs(e.funcs(clone))
	t, err := clone.New("tpl").Parse(text)
	if err != nil {
		return "", fmt.Errorf("tpl of %q: %w", text, parseError(err))
	}
	out, err := e.execute(t, data)
	if err != nil {
		return "", fmt.Errorf("tpl of %q: %w", text, err)
	}
	return out, nil
}

// failure is the error of `fail` and `required`: the chart author's message, which Helm
// shows without Go's template trace.
type failure struct{ msg string }

func (f *failure) Error() string { return f.msg }

func fail(msg string) (string, error) { return "", &failure{msg} }

// required passes its value through unless it is missing (nil) or the empty string.
// false and 0 are values.
func required(msg string, v interface{}) (interface{}, error) {
	if s, isString := v.(string); v == nil || (isString && s == "") {
		return v, &failure{msg}
	}
	return v, nil
}

// Go reports "template: <file>:<line>:<col>: executing ...": the first such location is
// the template being rendered (an include's or tpl's own trace follows it).
var execLocationRE = regexp.MustCompile(`^template: (.*?:\d+:\d+): executing `)

func execError(err error) error {
	var f *failure
	if errors.As(err, &f) {
		if m := execLocationRE.FindStringSubmatch(err.Error()); m != nil {
			return fmt.Errorf("execution error at (%s): %s", m[1], f.msg)
		}
	}
	return err
}

// Go: "template: <file>:<line>: <problem>"; Helm: "parse error at (<file>:<line>): <problem>".
var parseLocationRE = regexp.MustCompile(`(?s)^template: (.*?:\d+): (.*)$`)

func parseError(err error) error {
	if m := parseLocationRE.FindStringSubmatch(err.Error()); m != nil {
		return fmt.Errorf("parse error at (%s): %s", m[1], m[2])
	}
	return err
}

// ---- Helm's conversion functions: on bad input they return an empty string or carry the
// error in the result (fromYaml: an "Error" key), rather than stopping the render.

// toYAML marshals via JSON (so keys are sorted and numbers print as written), without the
// final newline, so that `toYaml . | nindent 4` ends cleanly.
func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func fromYAML(s string) valueMap {
	m := valueMap{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		return valueMap{"Error": err.Error()}
	}
	return m
}

func fromYAMLArray(s string) []interface{} {
	var a []interface{}
	if err := yaml.Unmarshal([]byte(s), &a); err != nil {
		return []interface{}{err.Error()}
	}
	return a
}

func toJSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(data)
}

func fromJSON(s string) valueMap {
	m := valueMap{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		return valueMap{"Error": err.Error()}
	}
	return m
}

func fromJSONArray(s string) []interface{} {
	var a []interface{}
	if err := json.Unmarshal([]byte(s), &a); err != nil {
		return []interface{}{err.Error()}
	}
	return a
}

func toTOML(v interface{}) string {
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(v); err != nil {
		return err.Error()
	}
	return b.String()
}

func fromTOML(s string) valueMap {
	m := valueMap{}
	if _, err := toml.Decode(s, &m); err != nil {
		return valueMap{"Error": err.Error()}
	}
	return m
}
