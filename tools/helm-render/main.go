// Command helm-render renders a Helm 3 chart directory the way `helm template` does, for
// machines where the helm binary cannot be had. It is written from Helm's documentation
// (values files, --set, built-in objects, template functions, install order), not from
// Helm's source; README.md lists what it does and does not reproduce.
//
//	helm-render [--release NAME] [--namespace NS] [-f FILE]... [--set K=V]...
//	            [--set-string K=V]... [--kube-version X.Y.Z] [-a GROUP/VERSION]...
//	            [--is-upgrade] [--skip-tests] [--notes | --dump-values] CHART_DIR
//
// Manifests go to stdout. --notes prints the rendered NOTES.txt instead; --dump-values
// prints the merged values as JSON and stops (tests/chart.py checks them against
// values.schema.json, as Helm does before rendering). Errors: "Error: ..." on stderr, exit 1.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"regexp"
	"strings"
)

type options struct {
	release, namespace, kubeVersion           string
	valueFiles, sets, setStrings, apiVersions listFlag
	isUpgrade, skipTests, notes, dumpValues   bool
	chartDir                                  string
}

// listFlag collects a repeatable flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, " ") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "Error: "+err.Error())
		os.Exit(1)
	}
}

func parseArgs(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("helm-render", flag.ContinueOnError)
	fs.StringVar(&o.release, "release", "release-name", "release name (.Release.Name)")
	fs.StringVar(&o.namespace, "namespace", "default", "namespace (.Release.Namespace)")
	fs.StringVar(&o.kubeVersion, "kube-version", defaultKubeVersion, "Kubernetes version (.Capabilities.KubeVersion)")
	fs.Var(&o.valueFiles, "f", "values file, repeatable; later files win")
	fs.Var(&o.valueFiles, "values", "same as -f")
	fs.Var(&o.sets, "set", "a.b=v,c[0]=w as helm --set, repeatable")
	fs.Var(&o.setStrings, "set-string", "as --set, every value a string")
	fs.Var(&o.apiVersions, "a", "extra .Capabilities.APIVersions (comma-separated), repeatable")
	fs.Var(&o.apiVersions, "api-versions", "same as -a")
	fs.BoolVar(&o.isUpgrade, "is-upgrade", false, ".Release.IsUpgrade instead of .Release.IsInstall")
	fs.BoolVar(&o.skipTests, "skip-tests", false, "leave out test hooks (helm.sh/hook: test)")
	fs.BoolVar(&o.notes, "notes", false, "print the rendered NOTES.txt instead of the manifests")
	fs.BoolVar(&o.dumpValues, "dump-values", false, "print the merged values as JSON and stop")
	// Like helm, accept flags after the chart argument: the flag package stops at the first
	// positional argument, so parse again from the one after it.
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			break
		}
		positional = append(positional, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(positional) != 1 {
		return nil, fmt.Errorf("expected one CHART_DIR argument, got %d: %q", len(positional), positional)
	}
	o.chartDir = positional[0]
	return o, nil
}

// Release names are DNS-1123 subdomains of at most 53 characters (Helm's documented rule).
var releaseNameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)

// run goes through the steps of `helm template` in the order in which Helm reports their
// failures: flags and values, the chart and its dependencies, release name, values,
// Kubernetes version, rendering.
func run(args []string) error {
	o, err := parseArgs(args)
	if err != nil {
		return err
	}
	kube, err := parseKubeVersion(o.kubeVersion)
	if err != nil {
		return err
	}
	user, err := userValues(o.valueFiles, o.sets, o.setStrings)
	if err != nil {
		return err
	}
	c, err := loadChart(o.chartDir)
	if err != nil {
		return err
	}
	if err := c.checkInstallable(); err != nil {
		return err
	}
	if len(o.release) > 53 || !releaseNameRE.MatchString(o.release) {
		return fmt.Errorf("release name %q: invalid release name, must match regex %s and the length must not be longer than 53",
			o.release, releaseNameRE)
	}
	values := withDefaults(c.values, user)
	if o.dumpValues {
		out, err := json.Marshal(values)
		if err != nil {
			return err
		}
		fmt.Println(string(out))
		return nil
	}
	if err := c.checkKubeVersion(kube); err != nil {
		return withHint(err)
	}
	caps := capabilities{KubeVersion: *kube, APIVersions: apiVersionSet(o.apiVersions), HelmVersion: helmVersion}
	release := map[string]interface{}{
		"Name": o.release, "Namespace": o.namespace, "Service": "Helm",
		"IsInstall": !o.isUpgrade, "IsUpgrade": o.isUpgrade, "Revision": 1,
	}
	rendered, err := renderChart(c, values, release, caps)
	if err != nil {
		return withHint(err)
	}
	// The manifests are split and checked even for --notes: a broken manifest fails helm
	// before any notes would be shown.
	out, err := manifestsOutput(rendered.files, o.skipTests)
	if err != nil {
		return withHint(err)
	}
	if o.notes {
		out = rendered.notes
	}
	fmt.Print(out)
	return nil
}

// withHint: helm template ends its rendering failures with this line; kept, so messages
// read the same with either renderer.
func withHint(err error) error {
	return fmt.Errorf("%w\n\nUse --debug flag to render out invalid YAML", err)
}
