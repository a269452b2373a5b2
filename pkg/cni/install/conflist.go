// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/containernetworking/cni/libcni"
)

// convertedFromKey marks our entry in a conflist the installer made out of a
// lone .conf, so uninstall can put the .conf back.
const convertedFromKey = "convertedFrom"

// confFiles lists the CNI configuration files in dir in the order runtimes
// try them: libcni's ConfFiles with the extensions containerd and CRI-O
// load (.conf, .conflist, .json), by name. A missing dir is an error here
// (libcni returns no files): the installer needs it to exist.
func confFiles(dir string) ([]string, error) {
	if _, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("read cni conf dir: %w", err)
	}
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return nil, fmt.Errorf("read cni conf dir %s: %w", dir, err)
	}
	slices.Sort(files)
	return files, nil
}

// ConfFile is one CNI configuration file as container runtimes read it.
type ConfFile struct {
	Path       string   `json:"path"`
	Name       string   `json:"name,omitempty"`       // the network's name
	CNIVersion string   `json:"cniVersion,omitempty"` // of the file
	Plugins    []string `json:"plugins,omitempty"`    // plugin types in chain order (one for a lone conf)
	// Err says why the file does not parse; containerd refuses to load
	// the directory then, CRI-O and the installer skip the file.
	Err string `json:"error,omitempty"`
}

// ReadConfDir reads dir's CNI configuration files in the order runtimes
// (libcni) try them. Runtimes use the first that parses; the installer
// chains into that one.
func ReadConfDir(dir string) ([]ConfFile, error) {
	files, err := confFiles(dir)
	if err != nil {
		return nil, err
	}
	out := make([]ConfFile, 0, len(files))
	for _, f := range files {
		cf := ConfFile{Path: f}
		data, err := os.ReadFile(f)
		if err == nil {
			var d *document
			if d, err = parseDocument(data); err == nil {
				_ = json.Unmarshal(d.fields["name"], &cf.Name)
				_ = json.Unmarshal(d.fields["cniVersion"], &cf.CNIVersion)
				if d.isList() {
					for _, p := range d.plugins {
						cf.Plugins = append(cf.Plugins, pluginType(p))
					}
				} else {
					cf.Plugins = []string{pluginType(data)}
				}
			}
		}
		if err != nil {
			cf.Err = err.Error()
		}
		out = append(out, cf)
	}
	return out, nil
}

// document is a CNI configuration file kept as raw JSON, so fields we do not
// know survive a rewrite untouched.
type document struct {
	fields  map[string]json.RawMessage
	plugins []json.RawMessage // nil for a single-plugin .conf
}

func parseDocument(data []byte) (*document, error) {
	d := &document{}
	if err := json.Unmarshal(data, &d.fields); err != nil {
		return nil, err
	}
	if d.fields == nil {
		return nil, errors.New("not a json object")
	}
	if raw, ok := d.fields["plugins"]; ok {
		if err := json.Unmarshal(raw, &d.plugins); err != nil {
			return nil, fmt.Errorf("plugins: %w", err)
		}
		if d.plugins == nil {
			d.plugins = []json.RawMessage{}
		}
		return d, nil
	}
	if _, ok := d.fields["type"]; !ok {
		return nil, errors.New("neither a conflist (plugins) nor a plugin conf (type)")
	}
	return d, nil
}

func (d *document) isList() bool { return d.plugins != nil }

func (d *document) marshal() ([]byte, error) {
	if d.isList() {
		raw, err := json.Marshal(d.plugins)
		if err != nil {
			return nil, err
		}
		d.fields["plugins"] = raw
	}
	out, err := json.MarshalIndent(d.fields, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

// pluginType reads the "type" of one plugin entry.
func pluginType(raw json.RawMessage) string {
	var p struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(raw, &p)
	return p.Type
}

// ours returns the index of our entry in the list, or -1.
func (d *document) ours(typ string) int {
	return slices.IndexFunc(d.plugins, func(p json.RawMessage) bool { return pluginType(p) == typ })
}

// withPlugin returns the conflist content with entry as the last plugin,
// replacing an older entry of the same type in place. A single-plugin conf is
// turned into a conflist; convertedFrom names the file it came from.
func withPlugin(data []byte, entry map[string]any, convertedFrom string) ([]byte, error) {
	d, err := parseDocument(data)
	if err != nil {
		return nil, err
	}
	if !d.isList() {
		d = asList(data)
		entry = withField(entry, convertedFromKey, convertedFrom)
	}
	typ, _ := entry["type"].(string)
	if i := d.ours(typ); i >= 0 {
		// Keep a conversion marker written by an earlier pass.
		var old map[string]any
		if json.Unmarshal(d.plugins[i], &old) == nil && old[convertedFromKey] != nil {
			entry = withField(entry, convertedFromKey, old[convertedFromKey])
		}
	}
	raw, err := json.Marshal(entry)
	if err != nil {
		return nil, err
	}
	if i := d.ours(typ); i >= 0 {
		d.plugins[i] = raw
		// Drop duplicates a broken earlier state may have left.
		d.plugins = slices.Concat(d.plugins[:i+1], slices.DeleteFunc(slices.Clone(d.plugins[i+1:]),
			func(p json.RawMessage) bool { return pluginType(p) == typ }))
	} else {
		d.plugins = append(d.plugins, raw)
	}
	return d.marshal()
}

// asList wraps the lone plugin conf data as the only plugin of a conflist
// with the conf's name and cniVersion, as libcni's ConfListFromConf does.
func asList(data []byte) *document {
	d := &document{fields: map[string]json.RawMessage{}, plugins: []json.RawMessage{data}}
	for _, k := range []string{"cniVersion", "name"} {
		if v, ok := parseFieldsOrNil(data)[k]; ok {
			d.fields[k] = v
		}
	}
	return d
}

// ownedKey marks a conflist the installer owns (Config.OwnedConflist); its
// value names the primary CNI's file the other plugins were copied from.
// libcni ignores top-level fields it does not know.
const ownedKey = "ambientEbpfOwnedFrom"

// isOwned reports whether d is a conflist the installer owns.
func (d *document) isOwned() bool {
	_, ok := d.fields[ownedKey]
	return ok
}

// ownedList builds the owned conflist from the primary CNI's file (named
// from): the primary's plugins without any entry of ours, then entry.
func ownedList(primary []byte, entry map[string]any, from string) ([]byte, error) {
	d, err := parseDocument(primary)
	if err != nil {
		return nil, err
	}
	if !d.isList() {
		d = asList(primary)
	}
	typ, _ := entry["type"].(string)
	d.plugins = slices.DeleteFunc(d.plugins, func(p json.RawMessage) bool { return pluginType(p) == typ })
	raw, err := json.Marshal(entry)
	if err != nil {
		return nil, err
	}
	d.plugins = append(d.plugins, raw)
	if d.fields[ownedKey], err = json.Marshal(from); err != nil {
		return nil, err
	}
	return d.marshal()
}

// withoutPlugin removes every entry of type typ from the content of the
// conflist file named listName. It returns the new content and, when the
// list had been converted from a .conf, that file's name and its original
// single-plugin content instead. The name comes from the file, so it is
// honoured only when it is the lone conf listName was made from (see
// restoreName); the list is then merely unchained.
func withoutPlugin(data []byte, typ, listName string) (out []byte, restoreAs string, changed bool, err error) {
	d, err := parseDocument(data)
	if err != nil {
		return nil, "", false, err
	}
	if !d.isList() || d.ours(typ) < 0 {
		return data, "", false, nil
	}
	for _, p := range d.plugins {
		if pluginType(p) != typ {
			continue
		}
		var m map[string]any
		if json.Unmarshal(p, &m) == nil {
			if s, ok := m[convertedFromKey].(string); ok && restoreName(listName, s) {
				restoreAs = s
			}
		}
	}
	d.plugins = slices.DeleteFunc(d.plugins, func(p json.RawMessage) bool { return pluginType(p) == typ })
	if restoreAs != "" && len(d.plugins) == 1 {
		var buf bytes.Buffer
		if err := json.Indent(&buf, d.plugins[0], "", "  "); err != nil {
			return nil, "", false, err
		}
		buf.WriteByte('\n')
		return buf.Bytes(), restoreAs, true, nil
	}
	out, err = d.marshal()
	return out, "", true, err
}

// restoreName reports whether convertedFrom names the lone conf that the
// conflist file listName was converted from: a bare .conf or .json file
// name whose conflist name (convertedName) is listName. Anything else (a
// path, "..", another file) would write outside the conf or over a file
// that is not ours.
func restoreName(listName, convertedFrom string) bool {
	switch filepath.Ext(convertedFrom) {
	case ".conf", ".json":
	default:
		return false
	}
	return filepath.Base(convertedFrom) == convertedFrom && !strings.ContainsRune(convertedFrom, 0) &&
		convertedName(convertedFrom) == listName
}

func parseFieldsOrNil(data []byte) map[string]json.RawMessage {
	var m map[string]json.RawMessage
	_ = json.Unmarshal(data, &m)
	return m
}

func withField(m map[string]any, k string, v any) map[string]any {
	out := make(map[string]any, len(m)+1)
	for key, val := range m {
		out[key] = val
	}
	out[k] = v
	return out
}

// convertedName is the conflist name for a lone .conf/.json file.
func convertedName(path string) string {
	return strings.TrimSuffix(path, filepath.Ext(path)) + ".conflist"
}
