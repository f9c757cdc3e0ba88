"""An offline viewer for Trace Event Format JSON: one self-contained HTML page that draws a trace.

``write_chrome_trace`` writes what Perfetto and chrome://tracing open; neither opens a file
without a person at it (Perfetto's UI is fetched from the network, chrome://tracing loads through
a file dialog, and headless Chromium refuses chrome:// pages). ``trace_html(doc)`` returns a page
with the document embedded and a timeline drawn by inline JavaScript when the page loads: a
summary table per process (spans by category, collectives by kind and bytes, counter samples),
then one band per process with a lane per thread (nested spans stacked), counters as stacked
areas, a time ruler; wheel to zoom, drag to pan, click a span for its args, ``#t=START,END``
(ms) in the address to open on a window. It needs no network and no other file.

    python -m fsdp_lite.tools.trace_view trace.json -o trace.html
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

__all__ = ["main", "trace_html", "write_trace_html"]

_CSS = """
body{font:13px/1.35 system-ui,sans-serif;margin:.8em 1.2em;color:#222}
h1{font-size:1.35em;margin:.1em 0 .3em}
table{border-collapse:collapse;margin:.3em 0 .6em}td,th{border:1px solid #ddd;padding:1px 6px;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}
#bar{margin:.3em 0}#bar button{margin-right:.6em}#window{font-variant-numeric:tabular-nums}
#timeline svg{display:block;border:1px solid #ddd;user-select:none;cursor:grab}
#timeline text{font-size:10px;pointer-events:none}#timeline text.p{font-size:12px;font-weight:bold}
#details{background:#f6f8fa;padding:.4em;min-height:1.4em;white-space:pre-wrap;font-size:12px}
.legend i{display:inline-block;width:11px;height:11px;margin:0 3px 0 10px;vertical-align:middle}
.muted{color:#777}
"""

# The page's script: reads the embedded document, fills #summary and draws #timeline. Kept to
# the phases fsdp_lite and torch.profiler write (M, X, B/E, i/I, C); flows and others are counted.
_JS = r"""
(function(){
var doc=JSON.parse(document.getElementById('trace-data').textContent);
var evs=Array.isArray(doc)?doc:(doc.traceEvents||[]);
var unit=(doc.displayTimeUnit==='ns')?['ns',1e-3]:['ms',1e3];
var procs={},order=[],tmin=Infinity,tmax=-Infinity,skipped=0;
function proc(pid){var k=String(pid);if(!(k in procs)){procs[k]={pid:pid,name:'pid '+pid,sort:null,
 threads:{},counters:{},corder:[]};order.push(k)}return procs[k]}
function thread(p,tid){var k=String(tid);if(!(k in p.threads))p.threads[k]={tid:tid,name:'thread '+tid,
 sort:null,spans:[],instants:[],open:[]};return p.threads[k]}
function seen(t){if(t<tmin)tmin=t;if(t>tmax)tmax=t}
evs.forEach(function(e){
 if(e===null||typeof e!=='object'||e.pid===undefined){skipped++;return}
 var p=proc(e.pid),ph=e.ph,a=e.args||{};
 if(ph==='M'){
  if(e.name==='process_name')p.name=String(a.name);
  else if(e.name==='process_sort_index')p.sort=a.sort_index;
  else if(e.name==='thread_name')thread(p,e.tid).name=String(a.name);
  else if(e.name==='thread_sort_index')thread(p,e.tid).sort=a.sort_index;
  return}
 if(typeof e.ts!=='number'){skipped++;return}
 if(ph==='X'){var d=typeof e.dur==='number'?e.dur:0;
  thread(p,e.tid).spans.push({ts:e.ts,dur:d,name:String(e.name),cat:e.cat||'',args:a,pid:e.pid,tid:e.tid});
  seen(e.ts);seen(e.ts+d)}
 else if(ph==='B'){thread(p,e.tid).open.push(e);seen(e.ts)}
 else if(ph==='E'){var t=thread(p,e.tid),b=t.open.pop();seen(e.ts);
  if(b)t.spans.push({ts:b.ts,dur:e.ts-b.ts,name:String(b.name),cat:b.cat||'',args:b.args||{},pid:e.pid,tid:e.tid})}
 else if(ph==='i'||ph==='I'){thread(p,e.tid).instants.push({ts:e.ts,name:String(e.name),args:a});seen(e.ts)}
 else if(ph==='C'){var n=String(e.name);if(!(n in p.counters)){p.counters[n]=[];p.corder.push(n)}
  p.counters[n].push({ts:e.ts,args:a});seen(e.ts)}
 else skipped++});
if(tmin===Infinity){tmin=0;tmax=1}if(tmax<=tmin)tmax=tmin+1;
function bysort(a,b){var x=a.sort===null?Infinity:a.sort,y=b.sort===null?Infinity:b.sort;
 return x!==y?(x<y?-1:1):(String(a.key)<String(b.key)?-1:String(a.key)>String(b.key)?1:0)}
var plist=order.map(function(k){var p=procs[k];p.key=typeof p.pid==='number'?p.pid:k;return p}).sort(bysort);
plist.forEach(function(p){
 p.tlist=Object.keys(p.threads).map(function(k){var t=p.threads[k];t.key=typeof t.tid==='number'?t.tid:k;return t})
  .filter(function(t){return t.spans.length||t.instants.length}).sort(bysort);
 p.tlist.forEach(function(t){// depth: how many drawn spans of the thread hold this one
  t.spans.sort(function(a,b){return a.ts-b.ts||b.dur-a.dur});var stack=[],depth=0;
  t.spans.forEach(function(s){while(stack.length&&stack[stack.length-1]<=s.ts)stack.pop();
   s.depth=stack.length;stack.push(s.ts+s.dur);if(s.depth>depth)depth=s.depth});t.depth=depth})});
function esc(s){return String(s).replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;').replace(/"/g,'&quot;')}
function human(b){var u=['B','KiB','MiB','GiB'],i=0;while(b>=1024&&i<3){b/=1024;i++}return (i?b.toFixed(1):b)+' '+u[i]}
// ---- the summary: what a reader counts first ----
var rows=['<tr><th>process</th><th>threads</th><th>compute</th><th>collectives</th><th>by kind</th>'+
 '<th>bytes</th><th>waits</th><th>user</th><th>other spans</th><th>counter samples</th></tr>'];
plist.forEach(function(p){var c={compute:0,collective:0,wait:0,user:0,other:0},kinds={},bytes=0,samples=0;
 p.tlist.forEach(function(t){t.spans.forEach(function(s){var k=s.cat in c&&s.cat!=='other'?s.cat:'other';c[k]++;
  if(s.cat==='collective'){var kind=String(s.args.kind||s.name);kinds[kind]=(kinds[kind]||0)+1;
   if(typeof s.args.bytes==='number')bytes+=s.args.bytes}})});
 p.corder.forEach(function(n){samples+=p.counters[n].length});
 var by=Object.keys(kinds).sort().map(function(k){return k+' '+kinds[k]}).join(', ');
 rows.push('<tr data-pid="'+esc(p.pid)+'"><td>'+esc(p.name)+'</td><td class="n">'+p.tlist.length+'</td><td class="n">'+
  c.compute+'</td><td class="n">'+c.collective+'</td><td>'+esc(by)+'</td><td class="n">'+(c.collective?human(bytes):'')+
  '</td><td class="n">'+c.wait+'</td><td class="n">'+c.user+'</td><td class="n">'+c.other+'</td><td class="n">'+samples+'</td></tr>')});
document.getElementById('summary').innerHTML=rows.join('');
document.getElementById('skipped').textContent=skipped?(skipped+' events of other phases (flows, ...) not drawn'):'';
// ---- colours: fsdp_lite's by kind and phase, anything else by a hash of its name ----
var KIND={all_gather:'#59a14f',reduce_scatter:'#f28e2b',all_reduce:'#e15759',all_to_all:'#b07aa1'};
var AREA=['#4e79a7','#f28e2b','#e15759','#76b7b2','#59a14f','#edc948','#b07aa1','#ff9da7','#9c755f'];
function hue(s){var h=0;for(var i=0;i<s.length;i++)h=(h*31+s.charCodeAt(i))%360;return h}
function colour(s){if(s.cat==='collective')return KIND[s.args.kind]||'#9c755f';
 if(s.cat==='wait')return '#ff9d9a';if(s.cat==='user')return '#bab0ac';
 if(s.cat==='compute')return s.args.phase==='backward'?'#a0cbe8':'#4e79a7';
 return 'hsl('+hue(s.name)+',45%,72%)'}
var legend=[['compute forward','#4e79a7'],['compute backward','#a0cbe8'],['all_gather',KIND.all_gather],
 ['reduce_scatter',KIND.reduce_scatter],['all_reduce',KIND.all_reduce],['all_to_all',KIND.all_to_all],['wait','#ff9d9a'],['user span','#bab0ac']];
document.getElementById('legend').innerHTML=legend.map(function(l){return '<i style="background:'+l[1]+'"></i>'+l[0]}).join('')+
 ' <span class="muted">other spans (e.g. torch.profiler\'s): a colour per name</span>';
// ---- the timeline ----
var LABEL=215,LANE=14,HEAD=20,AXIS=22,COUNTER=56,v0=tmin,v1=tmax,all=[];
function nice(x){var e=Math.pow(10,Math.floor(Math.log10(x))),f=x/e;return (f<1.5?1:f<3.5?2:f<7.5?5:10)*e}
function draw(){
 var W=Math.max(600,document.documentElement.clientWidth-40),plot=W-LABEL-8,k=plot/(v1-v0);
 function X(t){return LABEL+(t-v0)*k}
 var out=[],y=AXIS,step=nice((v1-v0)/8),first=Math.ceil((v0-tmin)/step)*step+tmin;all=[];
 for(var t=first;t<=v1;t+=step){var x=X(t).toFixed(1);out.push('<line x1="'+x+'" x2="'+x+'" y1="'+(AXIS-4)+'" y2="100%" stroke="#eee"/>'+
  '<text x="'+x+'" y="'+(AXIS-8)+'" text-anchor="middle">'+((t-tmin)/unit[1]).toFixed(step/unit[1]<1?2:0)+' '+unit[0]+'</text>')}
 plist.forEach(function(p){
  out.push('<rect x="0" y="'+y+'" width="'+W+'" height="'+HEAD+'" fill="#f0f3f6"/><text class="p" x="4" y="'+(y+14)+'" data-process="'+esc(p.pid)+'">'+esc(p.name)+'</text>');
  y+=HEAD;
  p.tlist.forEach(function(t){var h=(t.depth+1)*LANE;
   out.push('<text class="lane" x="10" y="'+(y+11)+'">'+esc(t.name)+'</text><line x1="0" x2="'+W+'" y1="'+(y+h)+'" y2="'+(y+h)+'" stroke="#eee"/>');
   t.spans.forEach(function(s){if(s.ts>v1||s.ts+s.dur<v0)return;var a=Math.max(X(s.ts),LABEL),b=Math.min(X(s.ts+s.dur),W-8),w=Math.max(b-a,0.6),yy=y+s.depth*LANE;
    all.push(s);out.push('<rect class="span" data-i="'+(all.length-1)+'" data-pid="'+esc(p.pid)+'" data-cat="'+esc(s.cat)+'" x="'+a.toFixed(2)+'" y="'+(yy+1)+'" width="'+w.toFixed(2)+
     '" height="'+(LANE-2)+'" fill="'+colour(s)+'"><title>'+esc(s.name)+' ('+(s.dur/unit[1]).toFixed(3)+' '+unit[0]+')</title></rect>');
    if(w>40)out.push('<text x="'+(a+2).toFixed(1)+'" y="'+(yy+11)+'">'+esc(s.name.slice(0,Math.floor(w/6)))+'</text>')});
   t.instants.forEach(function(s){if(s.ts<v0||s.ts>v1)return;var x=X(s.ts);
    out.push('<path d="M'+x.toFixed(1)+' '+(y+2)+'l4 8h-8z" fill="#cf222e"><title>'+esc(s.name)+'</title></path>')});
   y+=h});
  p.corder.forEach(function(n,ci){var samples=p.counters[n],keys=[];
   samples.forEach(function(s){Object.keys(s.args).forEach(function(key){if(keys.indexOf(key)<0)keys.push(key)})});
   var top=0;samples.forEach(function(s){var sum=0;keys.forEach(function(key){sum+=+s.args[key]||0});if(sum>top)top=sum});
   var h=Math.max(COUNTER,18+12*Math.ceil(keys.length/2)),base=y+h-2,sy=top?(h-8)/top:0,lower=samples.map(function(){return 0});
   keys.forEach(function(key,ki){var upper=samples.map(function(s,i){return lower[i]+(+s.args[key]||0)}),pts=[];
    samples.forEach(function(s,i){var x0=X(s.ts),x1=i+1<samples.length?X(samples[i+1].ts):X(v1);
     pts.push([x0,upper[i]],[x1,upper[i]])});var back=[];
    samples.forEach(function(s,i){var x0=X(s.ts),x1=i+1<samples.length?X(samples[i+1].ts):X(v1);back.unshift([x1,lower[i]],[x0,lower[i]])});
    var d=pts.concat(back).map(function(q,j){return (j?'L':'M')+Math.min(Math.max(q[0],LABEL),W-8).toFixed(1)+' '+(base-q[1]*sy).toFixed(1)}).join('')+'Z';
    out.push('<path class="counter" data-pid="'+esc(p.pid)+'" d="'+d+'" fill="'+AREA[ki%AREA.length]+'" fill-opacity="0.85"><title>'+esc(n+': '+key)+'</title></path>');lower=upper});
   out.push('<text class="lane" x="10" y="'+(y+11)+'">'+esc(n)+' <tspan class="muted">max '+esc(top.toLocaleString('en'))+'</tspan></text>');
   for(var j=0;j<keys.length;j+=2)out.push('<text x="10" y="'+(y+24+6*j)+'">'+keys.slice(j,j+2).map(function(key,ki){
    return '<tspan fill="'+AREA[(j+ki)%AREA.length]+'">\u25a0</tspan> '+esc(key)}).join(' ')+'</text>');
   y+=h})});
 document.getElementById('timeline').innerHTML='<svg width="'+W+'" height="'+(y+4)+'">'+out.join('')+'</svg>';
 document.getElementById('window').textContent=((v0-tmin)/unit[1]).toFixed(3)+' \u2013 '+((v1-tmin)/unit[1]).toFixed(3)+' '+unit[0]+
  ' of '+((tmax-tmin)/unit[1]).toFixed(3)+' '+unit[0]}
var m=/#t=([0-9.eE+-]+),([0-9.eE+-]+)/.exec(location.hash);
if(m&&+m[2]>+m[1]){v0=tmin+(+m[1])*unit[1];v1=tmin+(+m[2])*unit[1]}
draw();
var box=document.getElementById('timeline'),drag=null;
function at(ev){var r=box.querySelector('svg').getBoundingClientRect(),W=r.width,k=(W-LABEL-8)/(v1-v0);
 return v0+(ev.clientX-r.left-LABEL)/k}
box.addEventListener('wheel',function(ev){ev.preventDefault();var t=at(ev),f=ev.deltaY>0?1.25:0.8;
 v0=t-(t-v0)*f;v1=t+(v1-t)*f;draw()},{passive:false});
box.addEventListener('mousedown',function(ev){drag=[ev.clientX,v0,v1]});
window.addEventListener('mouseup',function(ev){if(drag&&Math.abs(ev.clientX-drag[0])<3&&ev.target.classList&&
 ev.target.classList.contains('span')){var s=all[+ev.target.getAttribute('data-i')];
  document.getElementById('details').textContent=s.name+'  '+(s.ts-tmin).toFixed(1)+' us + '+s.dur.toFixed(1)+' us\n'+JSON.stringify(s.args,null,1)}
 drag=null});
window.addEventListener('mousemove',function(ev){if(!drag)return;var r=box.querySelector('svg').getBoundingClientRect(),
 dt=(ev.clientX-drag[0])*(drag[2]-drag[1])/(r.width-LABEL-8);v0=drag[1]-dt;v1=drag[2]-dt;draw()});
document.getElementById('fit').addEventListener('click',function(){v0=tmin;v1=tmax;draw()});
window.addEventListener('resize',draw);
document.body.setAttribute('data-drawn',String(all.length));
})();
"""


def trace_html(doc: dict[str, Any] | list[dict[str, Any]], title: str = "Trace") -> str:
    """A self-contained HTML page that draws ``doc`` (a Trace Event Format document, or its bare
    event list) when opened; nothing in it is fetched."""
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    # "<" only occurs inside JSON strings, where \u003c reads the same: no "</script>" can end
    # the block early.
    data = data.replace("<", "\\u003c")
    other = doc.get("otherData", {}) if isinstance(doc, dict) else {}
    meta = escape(json.dumps(other, indent=1)) if other else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        '<table id="summary"></table><div id="skipped" class="muted"></div>'
        '<div id="bar"><button id="fit">fit</button><span id="window"></span> '
        '<span class="muted">wheel: zoom, drag: pan, click a span: its args</span></div>'
        '<div class="legend" id="legend"></div><div id="timeline"></div>'
        '<pre id="details">(click a span)</pre>'
        + (f"<details><summary>otherData</summary><pre>{meta}</pre></details>" if meta else "")
        + f'<script type="application/json" id="trace-data">{data}</script>'
        + f"<script>{_JS}</script></body></html>\n"
    )


def write_trace_html(
    source: str | Path | dict[str, Any] | list[dict[str, Any]],
    path: str | Path,
    title: str | None = None,
) -> Path:
    """Write ``trace_html`` of ``source`` (a trace file's path, or the document) to ``path``."""
    if isinstance(source, (dict, list)):
        doc, title = source, title or "Trace"
    else:
        doc, title = json.loads(Path(source).read_text()), title or Path(source).name
    path = Path(path)
    path.write_text(trace_html(doc, title))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lite.tools.trace_view",
        description="Write an offline HTML timeline of a Trace Event Format JSON file.",
    )
    parser.add_argument("trace", type=Path, help="the trace JSON (write_chrome_trace's, or any)")
    parser.add_argument("-o", "--out", type=Path, help="the page (default: TRACE with .html)")
    parser.add_argument("--title", help="the page's title (default: the file's name)")
    args = parser.parse_args(argv)
    out = write_trace_html(args.trace, args.out or args.trace.with_suffix(".html"), args.title)
    print(f"{out}: {out.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
