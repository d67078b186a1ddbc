package main

// Reading a chart directory: Chart.yaml, values.yaml, templates/, the other files (.Files),
// and what Helm checks before rendering (chart type, dependencies, kubeVersion).

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/Masterminds/semver/v3"
	"sigs.k8s.io/yaml"
)

// chartMetadata is Chart.yaml. Templates see it as .Chart, with Go's capitalised field
// names (.Chart.Name, .Chart.AppVersion, .Chart.KubeVersion...), as in Helm.
type chartMetadata struct {
	APIVersion   string            `json:"apiVersion"`
	Name         string            `json:"name"`
	Version      string            `json:"version"`
	KubeVersion  string            `json:"kubeVersion"`
	Description  string            `json:"description"`
	Type         string            `json:"type"`
	Keywords     []string          `json:"keywords"`
	Home         string            `json:"home"`
	Sources      []string          `json:"sources"`
	Dependencies []*dependency     `json:"dependencies"`
	Maintainers  []*maintainer     `json:"maintainers"`
	Icon         string            `json:"icon"`
	AppVersion   string            `json:"appVersion"`
	Deprecated   bool              `json:"deprecated"`
	Annotations  map[string]string `json:"annotations"`
	Condition    string            `json:"condition"` // Helm 2 leftovers, still accepted
	Tags         string            `json:"tags"`
}

type maintainer struct {
	Name  string `json:"name"`
	Email string `json:"email"`
	URL   string `json:"url"`
}

type dependency struct {
	Name         string        `json:"name"`
	Version      string        `json:"version"`
	Repository   string        `json:"repository"`
	Condition    string        `json:"condition"`
	Tags         []string      `json:"tags"`
	Enabled      bool          `json:"enabled"`
	ImportValues []interface{} `json:"import-values"`
	Alias        string        `json:"alias"`
}

type templateFile struct {
	name string // "<chart>/templates/<path>", Helm's name for it (# Source:, include)
	text string
}

type chart struct {
	meta      chartMetadata
	values    valueMap
	templates []templateFile // sorted by name
	files     files          // everything else a template may read (.Files)
	subcharts []string       // entries of charts/
}

func loadChart(dir string) (*chart, error) {
	raw, err := os.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, fmt.Errorf("%s is not a chart directory: %w", dir, err)
	}
	c := &chart{values: valueMap{}, files: files{}}
	if err := yaml.Unmarshal(raw, &c.meta); err != nil {
		return nil, fmt.Errorf("cannot load Chart.yaml: %w", err)
	}
	if err := c.meta.validate(); err != nil {
		return nil, err
	}
	ignore, err := readHelmignore(filepath.Join(dir, ".helmignore"))
	if err != nil {
		return nil, err
	}
	subcharts := map[string]bool{}
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		if rel == "." {
			return nil
		}
		if ignore.ignored(rel, d.IsDir()) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasPrefix(rel, "charts/") { // a subchart (directory or .tgz): not read
			subcharts[strings.SplitN(rel, "/", 3)[1]] = true
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case rel == "Chart.yaml", rel == "Chart.lock", rel == "values.schema.json":
			// the chart's own description; not among .Files
		case rel == "values.yaml":
			if c.values, err = parseYAMLValues(data); err != nil {
				return fmt.Errorf("cannot load values.yaml: %w", err)
			}
		case strings.HasPrefix(rel, "templates/"):
			c.templates = append(c.templates, templateFile{path.Join(c.meta.Name, rel), string(data)})
		default:
			c.files[rel] = data
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(c.templates, func(i, j int) bool { return c.templates[i].name < c.templates[j].name })
	for name := range subcharts {
		c.subcharts = append(c.subcharts, name)
	}
	sort.Strings(c.subcharts)
	return c, nil
}

func (m *chartMetadata) validate() error {
	switch {
	case m.APIVersion == "":
		return fmt.Errorf("validation: chart.metadata.apiVersion is required")
	case m.Name == "":
		return fmt.Errorf("validation: chart.metadata.name is required")
	case strings.ContainsAny(m.Name, `/\`):
		return fmt.Errorf("validation: chart.metadata.name %q is invalid", m.Name)
	case m.Version == "":
		return fmt.Errorf("validation: chart.metadata.version is required")
	}
	if _, err := semver.NewVersion(m.Version); err != nil {
		return fmt.Errorf("validation: chart.metadata.version %q is invalid", m.Version)
	}
	return nil
}

// checkInstallable: only application charts install; every dependency Chart.yaml declares
// must be in charts/, whatever its condition (Helm refuses before looking at values).
func (c *chart) checkInstallable() error {
	if c.meta.Type != "" && c.meta.Type != "application" {
		return fmt.Errorf("%s charts are not installable", c.meta.Type)
	}
	var missing []string
	for _, dep := range c.meta.Dependencies {
		if !c.hasSubchart(dep.Name) {
			missing = append(missing, dep.Name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("An error occurred while checking for chart dependencies. You may need to run "+
			"`helm dependency build` to fetch missing dependencies: found in Chart.yaml, but missing in "+
			"charts/ directory: %s", strings.Join(missing, ", "))
	}
	if len(c.subcharts) > 0 {
		return fmt.Errorf("subcharts not supported by helm-render (found charts/%s); use helm",
			strings.Join(c.subcharts, ", charts/"))
	}
	return nil
}

// hasSubchart: charts/NAME/ or a packaged charts/NAME-VERSION.tgz.
func (c *chart) hasSubchart(name string) bool {
	for _, entry := range c.subcharts {
		if entry == name {
			return true
		}
		if base := strings.TrimSuffix(entry, ".tgz"); base != entry && strings.HasPrefix(base, name+"-") {
			if _, err := semver.NewVersion(strings.TrimPrefix(base, name+"-")); err == nil {
				return true
			}
		}
	}
	return false
}

// checkKubeVersion: Chart.yaml's kubeVersion is a semver constraint on the cluster's
// version (`>=1.25.0-0`: the -0 admits pre-releases such as v1.30.2-gke.1).
func (c *chart) checkKubeVersion(kube *kubeVersion) error {
	if c.meta.KubeVersion == "" {
		return nil
	}
	constraint, err := semver.NewConstraint(c.meta.KubeVersion)
	if err != nil {
		return fmt.Errorf("invalid kubeVersion %q in Chart.yaml: %w", c.meta.KubeVersion, err)
	}
	version, err := semver.NewVersion(kube.Version)
	if err != nil || !constraint.Check(version) {
		return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes %s",
			c.meta.KubeVersion, kube.Version)
	}
	return nil
}

// ---- .helmignore
//
// As documented by Helm: one pattern per line, `#` comments, shell globs (path.Match, so no
// `**`); a pattern with a slash matches the path from the chart root (a leading `/` only
// anchors), one without matches the base name at any depth; a trailing `/` matches
// directories only; `!` re-includes. The last matching line decides.

type ignoreRule struct {
	pattern          string
	negate, dirOnly  bool
	matchesWholePath bool
}

type ignoreRules []ignoreRule

func readHelmignore(name string) (ignoreRules, error) {
	data, err := os.ReadFile(name)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var rules ignoreRules
	lines := bufio.NewScanner(bytes.NewReader(data))
	for lines.Scan() {
		line := strings.TrimSpace(lines.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		var r ignoreRule
		if strings.HasPrefix(line, "!") {
			r.negate, line = true, line[1:]
		}
		if strings.HasSuffix(line, "/") {
			r.dirOnly, line = true, strings.TrimRight(line, "/")
		}
		r.matchesWholePath = strings.Contains(line, "/")
		r.pattern = strings.TrimPrefix(line, "/")
		if _, err := path.Match(r.pattern, ""); err != nil {
			return nil, fmt.Errorf(".helmignore: bad pattern %q: %w", line, err)
		}
		rules = append(rules, r)
	}
	return rules, lines.Err()
}

func (rules ignoreRules) ignored(rel string, isDir bool) bool {
	ignored := false
	for _, r := range rules {
		if r.dirOnly && !isDir {
			continue
		}
		subject := path.Base(rel)
		if r.matchesWholePath {
			subject = rel
		}
		if ok, _ := path.Match(r.pattern, subject); ok {
			ignored = !r.negate
		}
	}
	return ignored
}
