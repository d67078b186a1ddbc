package main

// Values, layered as Helm documents it: the chart's values.yaml, then each -f file in
// order, then every --set, then every --set-string. Maps merge key by key; anything else
// (lists included) is replaced whole; a null removes the chart default beneath it.

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"
)

type valueMap = map[string]interface{}

// parseYAMLValues reads a values document. sigs.k8s.io/yaml converts YAML to JSON and
// decodes that, so every number comes out float64 (as in Helm: 268435456 | quote renders
// "2.68435456e+08"), and non-string keys become strings.
func parseYAMLValues(data []byte) (valueMap, error) {
	m := valueMap{}
	if err := yaml.Unmarshal(data, &m); err != nil {
		return nil, err
	}
	if m == nil { // an empty document, or a bare `null`
		m = valueMap{}
	}
	return m, nil
}

// userValues is everything the user gave, before the chart's defaults are laid under it.
func userValues(files, sets, setStrings []string) (valueMap, error) {
	user := valueMap{}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			return nil, err
		}
		m, err := parseYAMLValues(data)
		if err != nil {
			return nil, fmt.Errorf("failed to parse %s: %w", name, err)
		}
		mergeUser(user, m)
	}
	for _, arg := range sets {
		if err := applySet(user, arg, true); err != nil {
			return nil, fmt.Errorf("failed parsing --set data: %w", err)
		}
	}
	for _, arg := range setStrings {
		if err := applySet(user, arg, false); err != nil {
			return nil, fmt.Errorf("failed parsing --set-string data: %w", err)
		}
	}
	return user, nil
}

// mergeUser lays one user layer over the earlier ones. A null is kept (not applied as a
// deletion yet): it must still remove the chart's default when the defaults come in.
func mergeUser(dst, src valueMap) {
	for k, v := range src {
		if sub, ok := v.(valueMap); ok {
			if old, ok := dst[k].(valueMap); ok {
				mergeUser(old, sub)
				continue
			}
		}
		dst[k] = v
	}
}

// withDefaults lays the user's values over a copy of the chart's values.yaml.
func withDefaults(defaults, user valueMap) valueMap {
	out := deepCopy(defaults).(valueMap)
	overlay(out, user, "")
	return out
}

func overlay(dst, src valueMap, path string) {
	for k, v := range src {
		old, had := dst[k]
		oldMap, oldIsMap := old.(valueMap)
		newMap, newIsMap := v.(valueMap)
		switch {
		case v == nil && had:
			delete(dst, k) // `key: null` (or --set key=null) removes the default
		case newIsMap && oldIsMap:
			overlay(oldMap, newMap, path+k+".")
		default:
			if had && old != nil && oldIsMap != newIsMap {
				// Helm also warns here: a table replaced by a scalar or the reverse is
				// usually a typo in a values file.
				fmt.Fprintf(os.Stderr, "warning: %s%s: the chart's default %s is replaced by %s\n",
					path, k, describeKind(old), describeKind(v))
			}
			dst[k] = v
		}
	}
}

func describeKind(v interface{}) string {
	if _, ok := v.(valueMap); ok {
		return "table"
	}
	return fmt.Sprintf("non-table value (%v)", v)
}

func deepCopy(v interface{}) interface{} {
	switch v := v.(type) {
	case valueMap:
		out := make(valueMap, len(v))
		for k, x := range v {
			out[k] = deepCopy(x)
		}
		return out
	case []interface{}:
		out := make([]interface{}, len(v))
		for i, x := range v {
			out[i] = deepCopy(x)
		}
		return out
	}
	return v
}

// ---- --set and --set-string
//
// One argument holds comma-separated assignments, `path=value`. A path is names joined by
// dots, each optionally followed by list indexes: `a.b`, `servers[0].port`, `m[0][1]`.
// A value is text up to the next unescaped comma, or `{x,y}` for a list. A backslash makes
// the next character literal, in paths (`nodeSelector.kubernetes\.io/os`) as in values
// (`a=x\,y`). --set types values (see typedValue); --set-string keeps them all strings.

// maxSetIndex bounds `a[N]`, which creates N+1 list items.
const maxSetIndex = 65536

type pathStep struct {
	key     string
	index   int
	isIndex bool
}

// setScanner walks one --set argument.
type setScanner struct {
	text string
	pos  int
}

func (s *setScanner) done() bool { return s.pos >= len(s.text) }
func (s *setScanner) peek() byte { return s.text[s.pos] }

// until reads up to (not including) the first unescaped byte of stops, resolving escapes.
func (s *setScanner) until(stops string) string {
	var b strings.Builder
	for !s.done() {
		c := s.peek()
		if c == '\\' && s.pos+1 < len(s.text) {
			b.WriteByte(s.text[s.pos+1])
			s.pos += 2
			continue
		}
		if strings.IndexByte(stops, c) >= 0 {
			break
		}
		b.WriteByte(c)
		s.pos++
	}
	return b.String()
}

func applySet(dst valueMap, arg string, typed bool) error {
	s := &setScanner{text: arg}
	for !s.done() {
		if s.peek() == ',' { // empty assignment, e.g. a trailing comma
			s.pos++
			continue
		}
		start := s.pos
		path, err := s.path()
		if err != nil {
			return err
		}
		value, err := s.value(typed)
		if err != nil {
			return err
		}
		if _, err := put(dst, path, value, ""); err != nil {
			return fmt.Errorf("%s: %w", arg[start:s.pos], err)
		}
		if !s.done() {
			s.pos++ // the comma that ended the value
		}
	}
	return nil
}

// path reads `a.b[0].c=` and leaves the scanner after the '='.
func (s *setScanner) path() ([]pathStep, error) {
	var steps []pathStep
	var shown strings.Builder // the path as written so far, for messages
	for {
		name := s.until(".[=,")
		shown.WriteString(name)
		if name == "" {
			return nil, fmt.Errorf("empty key in %q", s.text)
		}
		steps = append(steps, pathStep{key: name})
		for !s.done() && s.peek() == '[' {
			s.pos++
			digits := s.until("],=")
			if s.done() || s.peek() != ']' {
				return nil, fmt.Errorf("key %q: missing ']' after index", shown.String())
			}
			s.pos++
			n, err := strconv.Atoi(digits)
			if err != nil || n < 0 {
				return nil, fmt.Errorf("key %q: list index %q is not a number >= 0", shown.String(), digits)
			}
			if n > maxSetIndex {
				return nil, fmt.Errorf("key %q: list index %d is above the limit of %d", shown.String(), n, maxSetIndex)
			}
			shown.WriteString("[" + digits + "]")
			steps = append(steps, pathStep{index: n, isIndex: true})
		}
		if s.done() || s.peek() == ',' {
			return nil, fmt.Errorf("key %q has no value", shown.String())
		}
		switch c := s.peek(); c {
		case '=':
			s.pos++
			return steps, nil
		case '.':
			s.pos++
			shown.WriteByte('.')
		default:
			return nil, fmt.Errorf("key %q: unexpected %q after a list index", shown.String(), c)
		}
	}
}

// value reads a scalar, or a `{a,b}` list, up to the comma that ends the assignment.
func (s *setScanner) value(typed bool) (interface{}, error) {
	convert := func(v string) interface{} {
		if typed {
			return typedValue(v)
		}
		return v
	}
	if s.done() || s.peek() != '{' {
		return convert(s.until(",")), nil
	}
	s.pos++
	list := []interface{}{}
	for {
		// `{}` gives one empty string, as in Helm: items are whatever lies between commas.
		list = append(list, convert(s.until(",}")))
		if s.done() {
			return nil, fmt.Errorf("list in %q must end with '}'", s.text)
		}
		c := s.peek()
		s.pos++
		if c == '}' {
			break
		}
	}
	if !s.done() && s.peek() != ',' {
		return nil, fmt.Errorf("unexpected %q after the list in %q", s.text[s.pos:], s.text)
	}
	return list, nil
}

// typedValue types a --set value as Helm does: true/false (any case) are booleans, null
// is nil, decimal integers are int64 (not float64, unlike numbers in files); anything
// else stays a string, including floats, and integers written with a leading 0 (ids, modes).
func typedValue(v string) interface{} {
	switch strings.ToLower(v) {
	case "true":
		return true
	case "false":
		return false
	case "null":
		return nil
	}
	if v == "0" {
		return int64(0)
	}
	if v != "" && v[0] != '0' {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			return n
		}
	}
	return v
}

// put stores value at path under node, creating maps and lists on the way, and returns
// the (possibly new) node. Maps and lists on the way are kept, so `a[0].x=1,a[0].y=2` and
// an -f file's list both survive; a scalar on the way is an error, not silently replaced.
func put(node interface{}, path []pathStep, value interface{}, where string) (interface{}, error) {
	if len(path) == 0 {
		return value, nil
	}
	step := path[0]
	if step.isIndex {
		here := fmt.Sprintf("%s[%d]", where, step.index)
		list, ok := node.([]interface{})
		if !ok && node != nil {
			return nil, fmt.Errorf("%s is %v, not a list", where, node)
		}
		for len(list) <= step.index {
			list = append(list, nil)
		}
		child, err := put(list[step.index], path[1:], value, here)
		if err != nil {
			return nil, err
		}
		list[step.index] = child
		return list, nil
	}
	here := step.key
	if where != "" {
		here = where + "." + step.key
	}
	m, ok := node.(valueMap)
	if !ok && node != nil {
		return nil, fmt.Errorf("%s is %v, not a map", where, node)
	}
	if m == nil {
		m = valueMap{}
	}
	child, err := put(m[step.key], path[1:], value, here)
	if err != nil {
		return nil, err
	}
	m[step.key] = child
	return m, nil
}
