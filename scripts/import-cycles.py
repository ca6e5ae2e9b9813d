#!/usr/bin/env python3
"""Import cycles between the files of one folder of the library crate (default
``peer``): an edge A -> B when file A names a path into file B (``use``, or any
``crate::``/``super::``/``self::``/child-module path outside comments and inline
tests). Prints the strongly connected components with more than one file, once
counting a ``mod.rs``'s ``pub use`` re-exports (its facade) and once without them.

    python3 scripts/import-cycles.py [FOLDER]     # e.g. peer, copy, engine
"""
import os
import re
import sys

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "kvferry", "src"))
root = sys.argv[1] if len(sys.argv) > 1 else "peer"
files={}
for d,_,fs in os.walk(root):
    for f in fs:
        if f.endswith('.rs'):
            p=os.path.join(d,f)
            parts=p[:-3].split('/')
            if parts[-1]=='mod': parts=parts[:-1]
            files[tuple(parts)]=p
def target(full):
    for n in range(len(full),0,-1):
        if tuple(full[:n]) in files: return tuple(full[:n])
def build(skip_reexports):
    edges={m:set() for m in files}
    for m,p in files.items():
        src=open(p).read()
        src=re.sub(r'//[^\n]*','',src)
        i=src.find('#[cfg(test)]\nmod tests')
        if i>=0: src=src[:i]
        if skip_reexports:
            src=re.sub(r'pub(\([^)]*\))? use [^;]*;','',src)
        children=re.findall(r'^\s*(?:pub(?:\([^)]*\))? )?mod (\w+);',src,re.M) if p.endswith('mod.rs') else []
        pat=r'\b((?:crate|super|self'+''.join('|'+c for c in children)+r')(?:::\w+)+)'
        # expand use groups a::{b, c::d}
        for u in re.finditer(r'use ([\w:]+)::\{([^}]*)\}', src):
            for item in re.split(r',\s*', u.group(2)):
                item=item.strip()
                if item: src+=f'\n{u.group(1)}::{item.split(" ")[0]};'
        for u in re.finditer(pat, src):
            segs=u.group(1).split('::')
            if segs[0]=='super':
                cur=list(m)
                while segs and segs[0]=='super': cur=cur[:-1]; segs=segs[1:]
                full=cur+segs
            elif segs[0]=='self': full=list(m)+segs[1:]
            elif segs[0]=='crate': full=segs[1:]
            else: full=list(m)+segs
            t=target(full)
            if t and t!=m: edges[m].add(t)
    return edges
def sccs(edges):
    idx={};low={};st=[];on=set();out=[];c=[0]
    sys.setrecursionlimit(10000)
    def sc(v):
        idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
        for w in edges[v]:
            if w not in idx: sc(w);low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],idx[w])
        if low[v]==idx[v]:
            comp=[]
            while True:
                w=st.pop();on.discard(w);comp.append(w)
                if w==v:break
            if len(comp)>1: out.append(comp)
    for v in edges:
        if v not in idx: sc(v)
    return out
for skip in (False, True):
    e=build(skip); cs=sccs(e)
    print('re-exports', 'ignored' if skip else 'counted', ':', len(cs), 'cycles')
    for s in cs:
        for a in s: print('   ', '/'.join(a), '->', ['/'.join(b) for b in e[a] if b in s])
